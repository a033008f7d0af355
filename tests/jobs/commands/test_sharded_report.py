"""`batchgen report` on a sharded job's local OUTPUT: one page over the shards (batchgen.jobs.commands.report).
The object-store case is in tests/jobs/sharding/test_s3_sharded.py."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.jobs.commands.report import render_report
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import tiny_job_config


def test_report_of_a_sharded_job_covers_every_shard(tmp_path, tiny_model_dir, loaded):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(12)] + [None]}), src)  # one error row
    out = tmp_path / "out"
    run_job(tiny_job_config(src, out, tiny_model_dir, max_new_tokens=3, num_shards=3, shard_index=2), loaded=loaded)
    run_job(tiny_job_config(src, out, tiny_model_dir, max_new_tokens=3, num_shards=3, shard_index=0), loaded=loaded)
    page = render_report(out, png=True)
    assert page.html_path == out / "_report" / "report.html" and len(page.png_paths) == 6
    html = page.html_path.read_text()
    assert "batchgen sharded job: out" in html and "Rows per job shard" in html
    assert re.search(r"shard 1</td><td>not started", html) and re.search(r"shard 2</td><td>complete", html)
    assert "incomplete: run (or rerun, to resume)" in html and "1 error rows" in html
    tokens = int(re.search(r"tokens generated \(all shards, all runs\)</td><td>([\d,]+)", html)[1].replace(",", ""))
    assert tokens > 0  # the shards' _metrics/ added up
    runner = CliRunner()
    result = runner.invoke(app, ["report", str(out), "--to", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["html"] == str(tmp_path / "r" / "report.html")
    missing = runner.invoke(app, ["report", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "not a batchgen output directory" in missing.output
