"""SIGTERM / SIGINT: stop admitting rows, commit the finished ones, exit 143 / 130; a second
signal exits at once and the next run still resumes to an exactly-once output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.engine.engine import LLMEngine
from batchgen.errors import JobInterrupted
from batchgen.io.manifest.manifest import SUCCESS_FILE, load_manifest
from batchgen.io.store import local_files
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.durability.signals import Interrupt, SignalGuard
from tests.jobs.helpers import tiny_job_config

NUM_ROWS = 40


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.parquet"
    texts = [f"prompt {i} " * (1 + i % 5) for i in range(NUM_ROWS)]
    pq.write_table(pa.table({"id": list(range(NUM_ROWS)), "text": texts}), path)
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(id_column="id", max_new_tokens=6, commit_every_rows=4,
                                                          batch_size=4), **overrides})


def ids_in(out):
    ids = ds.dataset(str(out), format="parquet").to_table().column("id").to_pylist()
    assert len(ids) == len(set(ids))
    return set(ids)


# ---------------------------------------------------------------- the guard itself


def test_guard_raises_at_once_outside_a_critical_section_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupt) as info:
        with SignalGuard():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # never reached: the handler raises first
    assert info.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_guard_defers_inside_a_critical_section():
    done = []
    with SignalGuard() as guard:
        with pytest.raises(Interrupt):
            with guard.critical():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("the section ran to its end")
        assert guard.interrupted and done


def test_the_last_line_before_a_forced_exit_is_an_error_line(monkeypatch, capfd):
    """A second signal and the grace timer end the process on the spot: what they print last reads
    as every other failure's last line does."""
    from batchgen.jobs.durability import signals

    exits = []

    def exit_now(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(signals.os, "_exit", exit_now)
    guard = SignalGuard()
    guard.signum = signal.SIGINT  # the first signal came
    with pytest.raises(SystemExit):
        guard._handle(signal.SIGINT, None)
    with pytest.raises(SystemExit):
        signals._exit_after_grace(signal.SIGTERM, 25)
    lines = capfd.readouterr().err.splitlines()
    assert exits == [130, 143]
    assert lines[0] == "error: second signal (SIGINT): exiting now; rerun the command to resume"
    assert lines[1].startswith("error: still stopping 25 s after the signal (--stop-grace-seconds): exiting now")


# ---------------------------------------------------------------- a job, in-process


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_generation_commits_finished_rows(tiny_model_dir, loaded, src, tmp_path, monkeypatch,
                                                        signum, code):
    out = tmp_path / "out"
    real_step = LLMEngine.step
    steps = []

    def step(self):
        steps.append(1)
        if len(steps) == 12:
            os.kill(os.getpid(), signum)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    with pytest.raises(JobInterrupted) as info:
        run_job(config(src, out, tiny_model_dir, commit_every_rows=1000), loaded=loaded)  # no commit before
    assert info.value.exit_code == code
    assert signal.Signals(signum).name in str(info.value) and "run the same command again" in str(info.value)
    assert len(steps) == 12  # stopped in that step: nothing more was admitted or run
    state = load_manifest(out)
    assert 0 < state.num_committed_rows < NUM_ROWS  # the finished rows were committed on the way out
    assert ids_in(out) == state.ok_ids and not (out / SUCCESS_FILE).exists()
    assert not (out / "_batchgen.lock").exists()
    partial = json.loads((out / "_summary.json").read_text())  # the task's sensors see how far it got
    assert partial["partial"] and not partial["complete"] and partial["output_rows"] == state.num_committed_rows
    monkeypatch.setattr(LLMEngine, "step", real_step)
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows_skipped == state.num_committed_rows
    assert ids_in(out) == set(range(NUM_ROWS)) and (out / SUCCESS_FILE).exists()


def test_signal_during_a_commit_lets_the_commit_finish(tiny_model_dir, loaded, src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    renames = []

    def signal_in_commit(stage):
        if stage == "rename":
            renames.append(stage)
            if len(renames) == 2:  # the second part's publish: half way through a commit
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(local_files, "_fault_hook", signal_in_commit)
    with pytest.raises(JobInterrupted):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    state = load_manifest(out)
    # the two commits before the signal, plus the rest of that step's finished rows: the signal
    # stops the job at the next step boundary, and everything finished by then commits
    assert state.num_committed_rows >= 8
    assert ids_in(out) == state.ok_ids  # the commit in flight was published whole


def test_signal_while_loading_the_model_leaves_no_directory(tiny_model_dir, src, tmp_path, monkeypatch):
    out = tmp_path / "new" / "out"

    def load_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("not reached")

    monkeypatch.setattr("batchgen.engine.model.loader.load_model", load_then_signal)  # imported when needed
    with pytest.raises(JobInterrupted) as info:
        run_job(config(src, out, tiny_model_dir))
    assert info.value.exit_code == 143
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- a job, as a process


def start_args(src, out, model_dir):
    return ["--input", str(src), "--output", str(out), "--model", str(model_dir), "--id-column", "id", "--device",
            "cpu", "--dtype", "float32", "--max-new-tokens", "64", "--ignore-eos", "--batch-size", "2",
            "--commit-every", "2", "--kv-cache-memory", "16MiB", "--quiet"]


def start(src, out, model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchgen", "run", *start_args(src, out, model_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_commits(proc, out, num_entries, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if len(list((out / "_manifest").glob("*.json"))) >= num_entries:
            return
        time.sleep(0.01)
    raise TimeoutError


@pytest.mark.soak
def test_sigterm_to_a_running_process(tiny_model_dir, loaded, src, tmp_path):
    out = tmp_path / "out"
    proc = start(src, out, tiny_model_dir)
    try:
        wait_for_commits(proc, out, 3)  # begin, inputs, one commit
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert time.monotonic() - t0 < 10
    assert "error: interrupted by SIGTERM while generating;" in stderr and "rows committed so far" in stderr
    assert_resumes(src, out, tiny_model_dir, loaded)


def test_a_second_signal_exits_at_once_even_mid_commit(tiny_model_dir, loaded, src, tmp_path):
    """Two signals from inside a commit (after its first rename): the first is deferred, the
    second exits on the spot, leaving a commit half published; the next run finishes it."""
    out = tmp_path / "out"
    code = f"""
import os, signal, sys
from batchgen.io.store import local_files
calls = []
def hook(stage):
    if stage == "rename":
        calls.append(stage)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            print("not reached", file=sys.stderr)
local_files._fault_hook = hook
sys.argv = {["batchgen", "run", *start_args(src, out, tiny_model_dir)]!r}
from batchgen.cli import main
main()
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr
    assert "second signal (SIGTERM): exiting now" in proc.stderr and "not reached" not in proc.stderr
    assert_resumes(src, out, tiny_model_dir, loaded)


def assert_resumes(src, out, model_dir, loaded):
    committed = load_manifest(out).num_committed_rows
    assert committed < NUM_ROWS
    summary = run_job(config(src, out, model_dir, max_new_tokens=64, ignore_eos=True, batch_size=2,
                             commit_every_rows=2), loaded=loaded)
    assert summary.num_rows_skipped == committed
    assert ids_in(out) == set(range(NUM_ROWS))
    assert json.loads((out / SUCCESS_FILE).read_text())["rows"] == NUM_ROWS
