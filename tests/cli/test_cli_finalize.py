"""`batchgen run --num-shards/--shard-index`, `finalize` and `status` on a sharded job, through the Typer app."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from batchgen.cli import app


def test_shards_then_finalize_with_exit_codes(tmp_path, tiny_model_dir):
    runner = CliRunner()
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"t{i}" for i in range(6)]}), src)
    out = tmp_path / "out"

    def run(*args):
        return runner.invoke(app, ["run", "--input", str(src), "--output", str(out), "--model", str(tiny_model_dir),
                                   "--device", "cpu", "--max-new-tokens", "2", "--kv-cache-memory", "16MiB",
                                   "--quiet", *args])

    bad = run("--num-shards", "2")
    assert bad.exit_code == 2 and "--num-shards needs --shard-index" in bad.output
    assert run("--num-shards", "2", "--shard-index", "2").exit_code == 2
    assert run("--num-shards", "2", "--shard-index", "1").exit_code == 0
    missing = runner.invoke(app, ["finalize", "--output", str(out)])
    assert missing.exit_code == 4 and "--shard-index 0" in missing.output
    status = json.loads(runner.invoke(app, ["status", "--output", str(out), "--json"]).output)
    assert status["state"] == "incomplete" and status["done"] == 3 and status["num_shards"] == 2
    assert run("--num-shards", "2", "--shard-index", "0").exit_code == 0
    done = runner.invoke(app, ["finalize", "--output", str(out)])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout.splitlines()[-1])["rows"] == 6
    assert "complete" in runner.invoke(app, ["status", "--output", str(out)]).output


def test_finalize_refuses_an_output_url_no_store_writes():
    result = CliRunner().invoke(app, ["finalize", "--output", "ftp://host/job"])
    assert result.exit_code == 2 and "not supported" in result.output
