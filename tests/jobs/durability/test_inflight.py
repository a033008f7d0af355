"""SIGTERM at random moments, then resume: rows in flight continue from their checkpoint.

In-process: the job runs in the main thread (where its signal handlers live) and a timer thread
sends the process a real SIGTERM after a random delay, up to two times per seed; then the same job
resumes to the end. Greedy and seeded sampling. Each seed checks that the final output equals an
uninterrupted run row for row (text, finish reason, token counts), that the tokens sampled over
all attempts are at most the uninterrupted run's plus the rows in flight at each signal (no row
starts over), and that a checkpointed row is never an output row.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pyarrow.dataset as ds
import pytest

from batchgen.config.job import build_config
from batchgen.errors import JobInterrupted
from batchgen.io.manifest.manifest import load_manifest
from batchgen.io.manifest.partials import read_partials
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status
from tests.jobs.helpers import write_random_texts

NUM_ROWS = 10
MAX_NEW_TOKENS = 48  # long rows next to a batch of 3: most signals land with rows in flight
NUM_SEEDS = 12  # per sampling mode: 24 seeds in all
SIGNALS_PER_SEED = 2
SAMPLING = {"greedy": {}, "seeded": {"temperature": 1.1, "top_p": 0.95, "seed": 7}}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_random_texts(tmp_path_factory.mktemp("inflight") / "in.parquet", NUM_ROWS, seed=3, max_chars=24)


def config(src, out, model_dir, **overrides):
    values = dict(inputs=[str(src)], output=str(out), model=str(model_dir), device="cpu", dtype="float32",
                  id_column="id", max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, kv_cache_memory="16MiB",
                  quiet=True, batch_size=3, commit_every_rows=2, stop_grace_s=0)  # 0: no exit timer in pytest
    values.update(overrides)
    return build_config(None, **values)


@pytest.fixture(autouse=True)
def harmless_late_signal():
    """A timer that fires just after a job ended must not terminate pytest."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


def output(out) -> dict:
    rows = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id is visible twice"
    return {r["id"]: {k: r[k] for k in ("generated_text", "finish_reason", "num_prompt_tokens",
                                        "num_generated_tokens", "prompt_hash")} for r in rows}


@pytest.fixture(scope="module")
def references(src, tiny_model_dir, loaded, tmp_path_factory):
    """Per sampling mode: the uninterrupted output, tokens sampled, wall seconds."""
    refs = {}
    for name, sampling in SAMPLING.items():
        times = []
        for attempt in range(2):  # the faster of two runs: one slowed by a busy machine would put
            out = tmp_path_factory.mktemp(f"ref-{name}-{attempt}") / "out"  # the signals after the end
            t0 = time.monotonic()
            summary = run_job(config(src, out, tiny_model_dir, **sampling), loaded=loaded)
            times.append(time.monotonic() - t0)
            assert summary.num_sampled_tokens == NUM_ROWS * MAX_NEW_TOKENS
        refs[name] = (output(out), summary.num_sampled_tokens, min(times))
    return refs


def interrupted_run(cfg, loaded, delay_s: float) -> bool:
    """Run until a SIGTERM sent after `delay_s`; False if the job finished first."""
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        run_job(cfg, loaded=loaded)
        return False
    except JobInterrupted as e:
        assert e.exit_code == 143
        return True
    finally:
        timer.cancel()


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.soak
def test_sigterm_at_random_moments_then_resume_equals_uninterrupted(src, tiny_model_dir, loaded, references,
                                                                   tmp_path, one_thread, mode):
    reference, reference_tokens, reference_s = references[mode]
    num_continued = num_signals = 0
    for seed in range(NUM_SEEDS):
        rng = random.Random(seed)
        out = tmp_path / f"seed-{seed}"
        cfg = config(src, out, tiny_model_dir, **SAMPLING[mode])
        tokens = in_flight_at_signals = 0
        for _ in range(SIGNALS_PER_SEED):
            summary_file = out / "_summary.json"  # absent after the run: the signal landed before the job
            summary_file.unlink(missing_ok=True)  # began generating (a previous attempt's must not count twice)
            interrupted = interrupted_run(cfg, loaded, rng.uniform(0.05, 0.7) * reference_s)
            attempt = json.loads(summary_file.read_text()) if summary_file.exists() else {
                "num_sampled_tokens": 0, "num_rows_continued": 0}
            tokens += attempt["num_sampled_tokens"]  # the attempt's, whether the signal or the end came first
            num_continued += attempt["num_rows_continued"]
            if not interrupted:
                break
            num_signals += 1
            if not (out / "_manifest").is_dir():
                continue  # the signal landed before the job began: it left nothing behind
            state = load_manifest(out)
            partials = read_partials(out, state.partials, state.partials["fingerprint"]) if state.partials else {}
            in_flight_at_signals += len(partials)
            committed = output(out) if state.num_committed_rows else {}
            assert set(committed) == state.ok_ids
            assert not {row_id for row_id, _ in partials} & set(committed), "a row is both committed and checkpointed"
            for (row_id, _), partial in partials.items():  # a checkpoint is a prefix of the uninterrupted row
                assert 0 < len(partial.token_ids) < reference[row_id]["num_generated_tokens"]
            assert job_status(out)["partial_rows"] == len(partials)
        summary = run_job(cfg, loaded=loaded)  # nothing left to do when an attempt above finished
        tokens += summary.num_sampled_tokens
        num_continued += summary.num_rows_continued
        assert output(out) == reference, f"seed {seed}: the resumed output differs from the uninterrupted run"
        assert tokens <= reference_tokens + in_flight_at_signals, f"seed {seed}: rows started over"
        assert tokens == reference_tokens, f"seed {seed}: {tokens - reference_tokens} tokens generated twice"
        final = load_manifest(out).partials
        assert final is None or final["num_rows"] == 0, "partials outlived their rows"
    assert num_signals >= NUM_SEEDS and num_continued > 0  # the signals did land mid-generation


def test_changed_config_drops_partials(src, tiny_model_dir, loaded, tmp_path, one_thread):
    out = tmp_path / "out"
    cfg = config(src, out, tiny_model_dir, commit_every_rows=1000)  # nothing committed before the signal
    from batchgen.engine.engine import LLMEngine

    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 20:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    LLMEngine.step = step
    try:
        with pytest.raises(JobInterrupted):
            run_job(cfg, loaded=loaded)
    finally:
        LLMEngine.step = real_step
    state = load_manifest(out)
    assert state.num_committed_rows == 0 and state.partials["num_rows"] == 3  # a full batch in flight
    # another max_new_tokens: a new job begins over no committed row, and the partials go with the old one
    summary = run_job(config(src, out, tiny_model_dir, max_new_tokens=MAX_NEW_TOKENS - 8), loaded=loaded)
    assert summary.num_rows_continued == 0
    assert summary.num_sampled_tokens == NUM_ROWS * (MAX_NEW_TOKENS - 8)
    assert load_manifest(out).partials is None
    assert not list((out / "_manifest").glob("*.partials.json"))


class HardKill(BaseException):
    """Stands in for kill -9 at a step boundary: no except clause of the job catches it, so
    nothing is committed or checkpointed on the way out."""


@pytest.mark.soak
def test_periodic_checkpoints_survive_a_hard_kill(src, tiny_model_dir, loaded, references, tmp_path, one_thread,
                                                   monkeypatch):
    from batchgen.engine.engine import LLMEngine

    reference, reference_tokens, _ = references["seeded"]
    out = tmp_path / "out"
    cfg = config(src, out, tiny_model_dir, **SAMPLING["seeded"], commit_every_rows=1000,
                 checkpoint_in_flight_every_s=1e-9)  # every step: the most a kill can find written
    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 70:
            raise HardKill
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    with pytest.raises(HardKill):
        run_job(cfg, loaded=loaded)
    monkeypatch.setattr(LLMEngine, "step", real_step)
    state = load_manifest(out)
    assert state.num_committed_rows == 0 and state.partials["num_rows"] == 3
    # 69 steps ran: the last checkpoint holds every token they sampled
    assert state.partials["num_tokens"] == sum(
        len(p.token_ids) for p in read_partials(out, state.partials, state.partials["fingerprint"]).values())
    summary = run_job(config(src, out, tiny_model_dir, **SAMPLING["seeded"]), loaded=loaded)
    assert summary.num_rows_continued == 3 and summary.num_tokens_continued == state.partials["num_tokens"]
    assert output(out) == reference
    assert summary.num_sampled_tokens == reference_tokens - summary.num_tokens_continued


def test_damaged_partials_are_ignored(src, tiny_model_dir, loaded, references, tmp_path, one_thread, monkeypatch):
    """A partial file that does not match its entry costs only the regeneration of its rows."""
    from batchgen.engine.engine import LLMEngine

    reference, reference_tokens, _ = references["greedy"]
    out = tmp_path / "out"
    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    with pytest.raises(JobInterrupted):
        run_job(config(src, out, tiny_model_dir, commit_every_rows=1000), loaded=loaded)
    monkeypatch.setattr(LLMEngine, "step", real_step)
    path = next((out / "_manifest").glob("*.partials.json"))
    path.write_text(path.read_text().replace("[", "[1,", 1))
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows_continued == 0 and summary.num_sampled_tokens == reference_tokens
    assert output(out) == reference


def test_grace_budget_bounds_signal_to_exit(tmp_path):
    """A job stuck past --stop-grace-seconds is ended by the guard's timer with 128 + signum."""
    import subprocess
    import sys

    child = ("import time, batchgen.jobs.durability.signals as s\n"
             "with s.SignalGuard(0.5) as g:\n"
             "    with g.deferred():\n"
             "        print('ready', flush=True)\n"
             "        time.sleep(60)  # a step that never ends\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert 0.4 < time.monotonic() - t0 < 10
    assert b"--stop-grace-seconds" in proc.stderr.read()


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_an_engine_fault_continues_rows_in_the_static_rerun(src, tiny_model_dir, loaded, references, tmp_path,
                                                            one_thread, monkeypatch, mode):
    """A continuous engine that fails mid-step: its rows go on in the static engine from the tokens
    they reached, greedy and seeded alike (a row's random stream is keyed by its output index, so
    its tokens are its whole state)."""
    from batchgen.config.choices import Policy
    from batchgen.engine.engine import LLMEngine
    from batchgen.engine.model_runner import ModelRunner

    reference, reference_tokens, _ = references[mode]
    real_run, steps = ModelRunner.run, []

    def flaky(self, out):
        if self.engine_policy is Policy.CONTINUOUS:
            steps.append(1)
            if len(steps) == 30:
                raise RuntimeError("injected fault")
        return real_run(self, out)

    real_init = LLMEngine.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.runner.engine_policy = self.config.policy

    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(ModelRunner, "run", flaky)
    summary = run_job(config(src, tmp_path / "out", tiny_model_dir, mode="continuous", **SAMPLING[mode]),
                      loaded=loaded)
    assert summary.num_static_fallbacks == 1
    assert output(tmp_path / "out") == reference
    assert summary.num_sampled_tokens == reference_tokens  # the rows in flight went on: nothing sampled twice
