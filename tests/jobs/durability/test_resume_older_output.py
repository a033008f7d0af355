"""An output directory an earlier batchgen wrote resumes under this one: its manifest names input
files with the keys it always had ("shards", "shard"), and its _metrics/ files call the planning
window's column "shard"; the resume continues both, and every reader sees windows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.manifest.manifest import MANIFEST_DIR
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status
from batchgen.monitor import store
from batchgen.monitor.report import render_job_report
from batchgen.monitor.store import metrics_dir, read_kind
from tests.jobs.helpers import committed_rows, tiny_job_config

TEXTS = [f"row {i} " + "abcdefghij"[: i % 10 + 1] for i in range(20)]


def as_written_before(out) -> int:
    """Rename the window column of every _metrics/ file back to "shard", as a batchgen before the
    rename wrote it; the number of files rewritten."""
    rewritten = 0
    for path in metrics_dir(out).glob("*.parquet"):
        table = pq.read_table(path)
        if "window" in table.column_names:
            pq.write_table(table.rename_columns(["shard" if c == "window" else c for c in table.column_names]), path)
            rewritten += 1
    return rewritten


def test_an_output_with_shard_named_metrics_resumes_and_reads_as_windows(tiny_model_dir, loaded, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(store, "MERGE_SEGMENTS", 2)  # the resume's flushes merge old files with new ones
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), src)
    out = tmp_path / "out"

    def config(**overrides):
        return tiny_job_config(src, out, tiny_model_dir, id_column="id", max_new_tokens=4, commit_every_rows=4,
                               batch_size=4, window_rows=4, metrics_every_s=0.05, **overrides)

    first = run_job(config(max_rows=8), loaded=loaded)
    assert first.num_rows == 8  # a run over the first rows (complete as far as --max-rows reads)
    # the manifest's input-file keys are the ones every version wrote and read
    entries = [json.loads(p.read_text()) for p in sorted((out / MANIFEST_DIR).glob("*.json"))]
    commits = [e for e in entries if e["op"] == "commit"]
    assert commits and all(e["shards"] == [str(src)] and len(e["write"][0]["shard"]) == 4 for e in commits)
    assert as_written_before(out) >= 2  # the steps and rows files at least
    assert read_kind(metrics_dir(out), "rows")["window"].to_pylist() == [0, 1]  # read under the new name

    second = run_job(config(), loaded=loaded)
    assert second.num_rows_skipped == 8 and second.num_rows == len(TEXTS) - 8 and second.complete
    assert sorted(committed_rows(out)) == list(range(len(TEXTS)))
    rows = read_kind(metrics_dir(out), "rows")
    by_run: dict[str, set] = {}
    for run_id, window, n in zip(rows["run_id"].to_pylist(), rows["window"].to_pylist(), rows["num_rows"].to_pylist(),
                                 strict=True):
        by_run.setdefault(run_id, set()).add(window)
        assert window is not None and n > 0  # no error rows: every row finished in a planned window
    assert len(by_run) == 2 and sum(rows["num_rows"].to_pylist()) == len(TEXTS)
    assert None not in set(read_kind(metrics_dir(out), "steps", columns=["window"])["window"].to_pylist())
    assert [(f["path"], f["done"], f["remaining"]) for f in job_status(out)["files"]] == [(str(src), len(TEXTS), 0)]
    assert "rows_per_window" in Path(render_job_report(out).html_path).read_text()
