"""A job's metrics: `_metrics/` consistent with the summary and the manifest after a normal run, a
SIGTERM and a SIGKILL; the Prometheus textfile parsed by prometheus_client's own parser, its counters
never lower after a resume; the HTTP endpoint scraped while a job runs; status --json's live figures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchgen.config.job import build_config
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status
from batchgen.monitor.report import render_job_report
from batchgen.monitor.store import metrics_dir, read_kind
from tests.jobs.kill_harness import JOB_ENV, job_args, make_fixture, reaped, sigkill, wait_until_locked

NUM_ROWS = 120


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return make_fixture(tmp_path_factory.mktemp("metrics-job"), NUM_ROWS)


def config(fixture, out, **overrides):
    values = dict(inputs=[str(fixture.src)], output=str(out), model=str(fixture.model_dir), id_column="id",
                  device="cpu", dtype="float32", max_new_tokens=8, kv_cache_memory="16MiB", batch_size=16,
                  commit_every_rows=16, quiet=True, metrics_every_s=0.2)
    values.update(overrides)
    return build_config(None, **values)


def read_textfile(path) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values


def sums(out, kind, *columns):
    table = read_kind(metrics_dir(out), kind)
    return tuple(sum(v or 0 for v in table[c].to_pylist()) for c in columns)


def test_metrics_match_the_summary_after_a_normal_run(fixture, tmp_path, one_thread):
    out, prom = tmp_path / "out", tmp_path / "job.prom"
    summary = run_job(config(fixture, out, metrics_textfile=str(prom)))
    engine = summary.engine
    steps, sampled, preempted = sums(out, "steps", "num_steps", "num_sampled_tokens", "num_preemptions")
    assert (steps, sampled, preempted) == (engine["num_steps"], engine["num_sampled_tokens"],
                                           engine["num_preemptions"])
    rows, errors, tokens = sums(out, "rows", "num_rows", "num_rows_error", "num_generated_tokens")
    assert (rows, errors, tokens) == (summary.num_rows, summary.num_rows_error, summary.num_generated_tokens)
    commits, committed = sums(out, "commits", "num_commits", "num_rows")
    assert (commits, committed) == (summary.num_commits, summary.num_rows)
    last = read_kind(metrics_dir(out), "commits").to_pylist()[-1]
    assert last["output_rows"] == summary.output_rows == NUM_ROWS
    # one record per second per kind (rows: per window and mode)
    times = read_kind(metrics_dir(out), "steps")["time_s"].to_pylist()
    assert len(times) == len(set(times))
    values = read_textfile(prom)
    assert values["batchgen_tokens_generated_total"] == sampled
    assert values["batchgen_engine_steps_total"] == steps
    assert values["batchgen_rows_finished_total"] == NUM_ROWS
    assert values["batchgen_output_rows"] == NUM_ROWS and values["batchgen_input_rows"] == NUM_ROWS
    assert values["batchgen_commits_total"] == summary.num_commits
    assert values["batchgen_prompt_tokens_per_second"] > 0
    prompt_tokens, = sums(out, "steps", "num_prompt_tokens")
    assert prompt_tokens == engine["num_prompt_tokens"] - engine["num_prefix_hit_tokens"]
    live = job_status(out)["live"]
    assert live["tokens_generated"] == sampled and live["tokens_per_s_last_minute"] > 0
    assert live["input_tokens_per_s_last_minute"] > 0
    # a complete job: nothing left and nothing running, whatever the last second's records said
    assert live["eta_seconds"] == 0 and live["running_sequences"] == 0
    (out / "_SUCCESS").unlink()  # as if the run had stopped before the end: no run holds it
    live = job_status(out)["live"]
    assert job_status(out)["state"] == "incomplete"
    assert live["eta_seconds"] is None and live["running_sequences"] == 0


def test_textfile_counters_never_go_backwards_across_a_resume(fixture, tmp_path, one_thread):
    out, prom = tmp_path / "out", tmp_path / "job.prom"
    first = run_job(config(fixture, out, metrics_textfile=str(prom), max_rows=40))
    before = read_textfile(prom)
    assert before["batchgen_output_rows"] == 40
    second = run_job(config(fixture, out, metrics_textfile=str(prom)))
    after = read_textfile(prom)
    counters = [name for name in before if name.endswith("_total")]
    assert len(counters) >= 8
    for name in counters:
        assert after[name] >= before[name], name
    assert after["batchgen_tokens_generated_total"] == (first.engine["num_sampled_tokens"]
                                                        + second.engine["num_sampled_tokens"])
    assert after["batchgen_rows_finished_total"] == NUM_ROWS
    assert len(set(read_kind(metrics_dir(out), "steps")["run_id"].to_pylist())) == 2
    # --overwrite starts the job over, and its metrics with it
    third = run_job(config(fixture, out, metrics_textfile=str(prom), max_rows=8, overwrite=True))
    assert read_textfile(prom)["batchgen_tokens_generated_total"] == third.engine["num_sampled_tokens"]


def test_no_metrics_writes_nothing(fixture, tmp_path, one_thread):
    out = tmp_path / "out"
    run_job(config(fixture, out, metrics=False, max_rows=16))
    assert not metrics_dir(out).exists()
    assert job_status(out)["live"] is None


# ---------------------------------------------------------------- subprocess jobs


def start(fixture, out, *extra: str, max_new_tokens: int = 48) -> subprocess.Popen:
    args = [*job_args(fixture, out), "--max-new-tokens", str(max_new_tokens), "--metrics-every-seconds", "0.2",
            *extra]
    return subprocess.Popen([sys.executable, "-m", "batchgen", "run", *args], env={**os.environ, **JOB_ENV},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.soak
def test_port_scraped_during_a_run_then_sigterm_keeps_consistent_metrics(fixture, tmp_path):
    out, port = tmp_path / "out", free_port()
    # a small batch keeps the job running well past its first commit, on a fast machine too
    proc = start(fixture, out, "--metrics-port", str(port), "--batch-size", "4")
    with reaped(proc):
        assert wait_until_locked(proc, out)
        seen = []
        for _ in range(200):  # bounded: at most 200 requests, 50 ms apart
            values = scrape(port)
            if values is not None:
                seen.append(values)
                if values.get("batchgen_output_rows", 0) > 0 and values["batchgen_tokens_generated_total"] > 0:
                    break
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be scraped mid-run"
        assert seen and seen[-1]["batchgen_tokens_generated_total"] > 0
        assert "batchgen_running_sequences" in seen[-1] and "batchgen_kv_cache_usage_ratio" in seen[-1]
        tokens = [v["batchgen_tokens_generated_total"] for v in seen]
        assert tokens == sorted(tokens)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 143, proc.stderr.read().decode()
    proc.stderr.close()
    assert scrape(port) is None  # the endpoint lives as long as the job
    state = load_manifest(out)
    assert 0 < state.num_committed_rows < NUM_ROWS
    # the interrupted run flushed everything: the commits records cover every committed row
    rows_committed, = sums(out, "commits", "num_rows")
    assert rows_committed == state.num_committed_rows
    rows_finished, = sums(out, "rows", "num_rows")
    assert rows_finished == state.num_committed_rows  # finished rows were committed before the exit


@pytest.mark.soak
def test_sigkill_leaves_readable_metrics_and_the_resume_continues_them(fixture, tmp_path, one_thread):
    out, prom = tmp_path / "out", tmp_path / "job.prom"
    # long rows, so the job still runs after its first commits while the report of it is drawn
    proc = start(fixture, out, "--metrics-textfile", str(prom), "--batch-size", "4", max_new_tokens=160)
    with reaped(proc):
        assert wait_until_locked(proc, out)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if prom.exists() and read_textfile(prom).get("batchgen_commits_total", 0) >= 2:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before the kill"
        # the report of a running job: it reads files only, so it works while the job writes them
        report = render_job_report(out, dest=tmp_path / "report-running").html_path.read_text()
        assert f"running (pid {proc.pid}" in report and report.count("data:image/png;base64,") == 6
        sigkill(proc)
    proc.stderr.close()
    files = sorted(metrics_dir(out).glob("*.parquet"))
    assert files
    for path in files:  # every file there is a whole Parquet file
        pq.read_table(path)
    state = load_manifest(out)
    rows_committed, = sums(out, "commits", "num_rows")
    assert 0 < rows_committed <= state.num_committed_rows  # the last commits may not have been flushed yet
    before = read_textfile(prom)
    summary = run_job(config(fixture, out, metrics_textfile=str(prom), max_new_tokens=160))
    after = read_textfile(prom)
    for name in (n for n in before if n.endswith("_total")):
        assert after[name] >= before[name], name
    assert after["batchgen_output_rows"] == NUM_ROWS == summary.output_rows
    # the resumed run's own figures are all on disk and add up with its summary
    steps = [r for r in read_kind(metrics_dir(out), "steps").to_pylist() if r["run_id"] != _first_run(out)]
    assert sum(r["num_sampled_tokens"] for r in steps) == summary.engine["num_sampled_tokens"]


def _first_run(out) -> str:
    return read_kind(metrics_dir(out), "steps")["run_id"][0].as_py()


def test_status_json_has_live_figures_from_the_cli(fixture, tmp_path, one_thread):
    out = tmp_path / "out"
    run_job(config(fixture, out, max_rows=32))
    proc = subprocess.run([sys.executable, "-m", "batchgen", "status", "--output", str(out), "--json"],
                          capture_output=True, text=True, env={**os.environ, **JOB_ENV})
    assert proc.returncode == 0, proc.stderr
    live = json.loads(proc.stdout)["live"]
    assert set(live) >= {"tokens_per_s_last_minute", "eta_seconds", "running_sequences", "kv_cache_usage"}


def test_bad_metrics_flags_are_user_errors(fixture, tmp_path, one_thread):
    from batchgen.errors import ConfigError

    with pytest.raises(ConfigError, match="--metrics-textfile"):
        run_job(config(fixture, tmp_path / "out", metrics_textfile=str(tmp_path / "missing" / "job.prom")))
    with pytest.raises(ConfigError, match="metrics_port"):
        config(fixture, tmp_path / "out2", metrics_port=70000)
    with pytest.raises(ConfigError, match="metrics_every_s"):
        config(fixture, tmp_path / "out3", metrics_every_s=0)
