"""MetricsRecorder: one record per second per kind, sums equal to the events, counters that show only
what was flushed and start from what earlier runs wrote."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.engine.metrics import StepStats
from batchgen.monitor import recorder as recorder_module
from batchgen.monitor.eta import PredictedWork, WorkMeter
from batchgen.monitor.recorder import MetricsRecorder
from batchgen.monitor.store import metrics_dir, read_kind


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock(1_000_000.0)
    monkeypatch.setattr(recorder_module.time, "time", c)
    return c


def step(n_sampled: int, running: int = 4, used: int = 10, secs: float = 0.01, preempted: int = 0) -> StepStats:
    return StepStats(step_seconds=secs, num_running=running, num_waiting=2, num_batched_tokens=n_sampled + 3,
                     num_sampled_tokens=n_sampled, num_kv_blocks_used=used, num_kv_blocks_free=90 - used,
                     num_preempted=preempted, num_prefix_hit_tokens=1, num_prompt_tokens=3)


def make(tmp_path, **kw) -> MetricsRecorder:
    return MetricsRecorder(tmp_path, run_id=kw.pop("run_id", "r1"), write_files=True, every_s=3600,
                           context=lambda: ("continuous", 0), **kw)


def test_steps_aggregate_to_one_record_per_second(tmp_path, clock):
    rec = make(tmp_path)
    for i in range(250):  # 250 steps over 2.5 s
        clock.t = 1_000_000.0 + i * 0.01
        rec.on_step(step(3, running=i % 7, preempted=int(i == 7)))
    rec.close()
    table = read_kind(metrics_dir(tmp_path), "steps")
    assert table["time_s"].to_pylist() == [1_000_000, 1_000_001, 1_000_002]
    assert table["num_steps"].to_pylist() == [100, 100, 50]
    assert sum(table["num_sampled_tokens"].to_pylist()) == 750
    assert sum(table["num_preemptions"].to_pylist()) == 1
    assert sum(table["num_prefix_hit_tokens"].to_pylist()) == 250
    assert [sum(c) for c in table["step_hist_count"].to_pylist()] == [100, 100, 50]
    assert table["num_running_max"].to_pylist() == [6, 6, 6]
    assert set(table["mode"].to_pylist()) == {"continuous"} and set(table["run_id"].to_pylist()) == {"r1"}


def test_rows_and_commits(tmp_path, clock):
    rec = make(tmp_path)
    for i in range(40):
        rec.on_row(window=i % 2, mode="static", num_prompt_tokens=5, num_generated_tokens=i, predicted_tokens=20,
                   error=False)
    rec.on_row(window=None, mode=None, num_prompt_tokens=0, num_generated_tokens=0, predicted_tokens=None, error=True)
    rec.on_commit(seconds=0.5, output_rows=41, output_rows_error=1)
    rec.close()
    rows = read_kind(metrics_dir(tmp_path), "rows")
    assert sorted(zip(rows["window"].to_pylist(), rows["num_rows"].to_pylist(), strict=True),
                  key=lambda x: (x[0] is None, x[0] or 0)) == [(0, 20), (1, 20), (None, 1)]
    assert sum(rows["num_generated_tokens"].to_pylist()) == sum(range(40))
    samples = rows["sample_actual_tokens"].to_pylist()
    assert all(len(s) == 16 for s in samples[:2]) and samples[2] == []
    assert set(rows["sample_predicted_tokens"].to_pylist()[0]) == {20}
    commits = read_kind(metrics_dir(tmp_path), "commits").to_pylist()
    assert len(commits) == 1
    c = commits[0]
    assert (c["num_rows"], c["num_rows_error"], c["num_generated_tokens"], c["output_rows"]) == (41, 1, 780, 41)


def test_counters_show_what_was_flushed_and_resume_from_the_files(tmp_path, clock):
    rec = make(tmp_path)
    rec.on_step(step(5))
    assert rec.snapshot().totals.num_generated_tokens == 0  # not on disk yet
    clock.t += 1
    rec.flush()
    assert rec.snapshot().totals.num_generated_tokens == 5
    rec.on_step(step(7))
    rec.close()
    assert rec.snapshot().totals.num_generated_tokens == 12
    again = make(tmp_path, run_id="r2")
    assert again.snapshot().totals.num_generated_tokens == 12  # seeded from the files: never lower
    assert again.snapshot().totals.num_engine_steps == 2


def test_tokens_per_second_and_the_meters_eta(tmp_path, clock):
    """Output and prompt tokens/s over the last minute; the ETA is the job's WorkMeter's, in the
    snapshot (Prometheus) and in each steps record (status)."""
    meter = WorkMeter(lambda: PredictedWork(0, 5000), clock=clock)
    rec = make(tmp_path, meter=meter)
    for i in range(300):  # 100 sampled and 30 prompt tokens per second for 30 s
        clock.t = 1_000_000.0 + i * 0.1
        rec.on_step(step(10))
        meter.on_step(step(10))
    clock.t = 1_000_030.0
    snap = rec.snapshot()
    assert snap.tokens_per_s == pytest.approx(100, rel=0.05)
    assert snap.input_tokens_per_s == pytest.approx(30, rel=0.05)
    assert snap.eta_seconds == pytest.approx(meter.estimate().eta_s, abs=0.05)
    assert snap.eta_seconds > 0
    rec.close()
    etas = read_kind(metrics_dir(tmp_path), "steps")["eta_seconds"].to_pylist()
    assert etas[-1] == pytest.approx(snap.eta_seconds, abs=0.05)


def test_monitor_modules_import_no_torch():
    """status and report read metrics files without loading torch (seconds of start-up)."""
    code = ("import sys; import batchgen.monitor.report, batchgen.monitor.live; "
            "print(sorted(m for m in sys.modules if m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rows_records_and_counters_carry_what_rows_took_from_other_rows(tmp_path, clock):
    """Shareable prefix tokens, prefix-hit prompt tokens and rows served from a duplicate: summed per
    second in the rows records, and counters (Prometheus) over every run, older files counting 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from batchgen.monitor.prometheus import PrometheusExport
    from batchgen.monitor.records import ROWS_SCHEMA

    directory = metrics_dir(tmp_path)
    directory.mkdir()
    old = pa.schema([f.with_name("shard") if f.name == "window" else f  # the window column's old name
                     for f in ROWS_SCHEMA if f.name not in ("num_shareable_prefix_tokens",
                                                            "num_prefix_hit_prompt_tokens",
                                                            "num_rows_from_duplicates")])
    pq.write_table(pa.Table.from_pylist([{"run_id": "r0", "time_s": 999_000, "shard": 0, "mode": "static",
                                          "num_rows": 3, "num_rows_error": 0, "num_prompt_tokens": 30,
                                          "num_generated_tokens": 9, "sample_predicted_tokens": [],
                                          "sample_actual_tokens": []}], schema=old),
                   directory / "rows-00000001-00000001.parquet")  # written before these columns existed
    rec = make(tmp_path)
    assert rec.snapshot().totals.num_rows == 3 and rec.snapshot().totals.num_shareable_prefix_tokens == 0
    rec.on_row(window=0, mode="continuous", num_prompt_tokens=80, num_generated_tokens=4, predicted_tokens=4,
               error=False)  # a group's leader
    for _ in range(3):  # its followers
        rec.on_row(window=0, mode="continuous", num_prompt_tokens=80, num_generated_tokens=4, predicted_tokens=4,
                   error=False, num_shareable_prefix_tokens=64, num_prefix_hit_prompt_tokens=48)
    rec.on_row(window=0, mode="continuous", num_prompt_tokens=80, num_generated_tokens=4, predicted_tokens=4,
               error=False, from_duplicate=True)
    rec.close()
    rows = read_kind(directory, "rows")
    assert rows["num_shareable_prefix_tokens"].to_pylist() == [None, 192]
    assert rows["num_prefix_hit_prompt_tokens"].to_pylist() == [None, 144]
    assert rows["num_rows_from_duplicates"].to_pylist() == [None, 1]
    assert rows["window"].to_pylist() == [0, 0]
    totals = make(tmp_path, run_id="r2").snapshot().totals  # a resume's counters start from the files
    assert (totals.num_rows, totals.num_shareable_prefix_tokens, totals.num_prefix_hit_prompt_tokens,
            totals.num_rows_from_duplicates) == (8, 192, 144, 1)
    export = PrometheusExport(rec, textfile=None, port=None, host="127.0.0.1")
    values = {s.name: s.value for family in text_string_to_metric_families(generate_latest(export.registry).decode())
              for s in family.samples}
    assert values["batchgen_shareable_prefix_tokens_total"] == 192
    assert values["batchgen_prefix_hit_prompt_tokens_total"] == 144
    assert values["batchgen_rows_from_duplicates_total"] == 1
    assert values["batchgen_rows_finished_total"] == 8
