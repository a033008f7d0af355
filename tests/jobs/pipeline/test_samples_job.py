"""n samples per row through run_job on the tiny random Llama: one output row per sample keyed by
(id, sample_index), written exactly once across SIGTERM and resume; --n, a sampling cell's n, the
fingerprint, compaction, and jobs without n keeping today's schema."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.config.job import build_config
from batchgen.engine.model.loader import load_model
from batchgen.errors import FingerprintMismatch, JobInterrupted
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status
from tests.jobs import kill_harness
from tests.jobs.helpers import committed_rows, tiny_job_config, write_random_texts

NUM_ROWS = 8
SAMPLED = {"temperature": 1.1, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_random_texts(tmp_path_factory.mktemp("samples") / "in.parquet", NUM_ROWS, seed=4, max_chars=30)


def config(src, out, model_dir, **overrides):
    values = dict(id_column="id", chat=False, max_new_tokens=24, ignore_eos=True, batch_size=4,
                  commit_every_rows=2, stop_grace_s=0, **SAMPLED)
    values.update(overrides)
    return tiny_job_config(src, out, model_dir, **values)


def sample_rows(out) -> dict[tuple[int, int], dict]:
    """Every committed row by (id, sample_index); fails on a key seen twice (exactly-once)."""
    rows = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    keys = [(r["id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "an (id, sample_index) appears twice"
    return {(r["id"], r["sample_index"]): {k: r[k] for k in ("generated_text", "finish_reason", "num_prompt_tokens",
                                                              "num_generated_tokens")} for r in rows}


@pytest.fixture(scope="module")
def reference(src, tiny_model_dir, loaded, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    run_job(config(src, out, tiny_model_dir, n=3), loaded=loaded)
    return out


@pytest.fixture(scope="module")
def reference_s(src, tiny_model_dir, loaded, tmp_path_factory) -> float:
    """Wall seconds of the uninterrupted job (the faster of two): signals are timed within it."""
    times = []
    for _ in range(2):
        started = time.monotonic()
        run_job(config(src, tmp_path_factory.mktemp("timed") / "out", tiny_model_dir, n=3), loaded=loaded)
        times.append(time.monotonic() - started)
    return min(times)


def test_n3_writes_three_rows_per_id_with_sample_index(reference, src, tiny_model_dir, loaded, tmp_path, one_thread):
    rows = sample_rows(reference)
    assert set(rows) == {(i, s) for i in range(NUM_ROWS) for s in range(3)}
    schema = pq.read_schema(next(p for p in reference.rglob("part-*.parquet")))
    assert schema.names[:2] == ["id", "sample_index"] and schema.field("sample_index").type == pa.int32()
    for i in range(NUM_ROWS):
        assert len({rows[i, s]["generated_text"] for s in range(3)}) == 3, "the samples drew the same stream"
        assert rows[i, 0]["num_prompt_tokens"] == rows[i, 2]["num_prompt_tokens"]
    assert job_status(reference)["done"] == NUM_ROWS  # rows count input rows
    # a job without n keeps today's schema; its text is sample 0's (sample 0 keeps the row's seed)
    one = tmp_path / "one"
    run_job(config(src, one, tiny_model_dir), loaded=loaded)
    single = committed_rows(one)
    assert "sample_index" not in pq.read_schema(next(p for p in one.rglob("part-*.parquet"))).names
    assert all(single[i]["generated_text"] == rows[i, 0]["generated_text"] for i in range(NUM_ROWS))


def test_a_resume_with_another_n_is_refused(reference, src, tiny_model_dir, loaded, one_thread):
    with pytest.raises(FingerprintMismatch, match="n"):
        run_job(config(src, reference, tiny_model_dir, n=2), loaded=loaded)


def test_a_rows_samples_never_split_across_parts_and_compact_keeps_them(reference, src, tiny_model_dir, loaded,
                                                                        tmp_path, one_thread):
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, n=3, rows_per_part=2, commit_every_rows=1), loaded=loaded)
    assert sample_rows(out) == sample_rows(reference)
    for part in out.rglob("part-*.parquet"):  # a row's 3 samples are more than 2 rows: a part each
        table = pq.read_table(part)
        assert table.column("sample_index").to_pylist() == [0, 1, 2]
    assert (out / "_SUCCESS").exists()
    compact_output(out)
    [part] = list(out.rglob("part-*.parquet"))
    table = pq.read_table(part)
    assert table.column("id").to_pylist() == [i for i in range(NUM_ROWS) for _ in range(3)]
    assert table.column("sample_index").to_pylist() == [0, 1, 2] * NUM_ROWS
    assert sample_rows(out) == sample_rows(reference)
    assert load_manifest(out).num_committed_rows == NUM_ROWS


def test_a_sampling_cell_asks_for_its_own_n(tmp_path, tiny_model_dir, loaded, one_thread):
    src = tmp_path / "in.parquet"
    cells = [None, json.dumps({"n": 2}), json.dumps({"n": 1, "temperature": 0.5}), json.dumps({"n": 0})]
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "text": ["aa b", "c dd", "eee f", "g"], "s": cells}), src)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, sampling_column="s"), loaded=loaded)
    rows = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    keys = sorted((r["id"], r["sample_index"]) for r in rows)
    assert keys == sorted([(0, 0), (1, 0), (1, 1), (2, 0), (3, None)])
    [error] = [r for r in rows if r["id"] == 3]
    assert "n must be in [1, 128]" in error["error"] and "'s'" in error["error"]


@pytest.fixture
def harmless_late_signal():
    """A timer that fires just after a job ended must not terminate pytest."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


def interrupted_run(cfg, loaded, delay_s: float) -> bool:
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        run_job(cfg, loaded=loaded)
        return False
    except JobInterrupted:
        return True
    finally:
        timer.cancel()


@pytest.mark.usefixtures("harmless_late_signal")
@pytest.mark.soak
def test_sigterm_then_resume_writes_every_sample_exactly_once(reference, reference_s, src, tiny_model_dir, loaded,
                                                              tmp_path, one_thread):
    expected = sample_rows(reference)
    num_interrupted = num_partials = 0
    for seed in range(5):
        rng = random.Random(seed)
        out = tmp_path / f"seed-{seed}"
        cfg = config(src, out, tiny_model_dir, n=3, checkpoint_in_flight_every_s=0)
        for _ in range(2):
            if not interrupted_run(cfg, loaded, rng.uniform(0.05, 0.7) * reference_s):
                break
            num_interrupted += 1
            if (out / "_manifest").is_dir():
                state = load_manifest(out)
                num_partials += state.partials["num_rows"] if state.partials else 0
                committed = sample_rows(out) if state.num_committed_rows else {}
                # what is committed is whole rows, each sample as the uninterrupted run wrote it
                assert {i for i, _ in committed} == set(state.ok_ids)
                assert all(committed[key] == expected[key] for key in committed)
                assert len(committed) == 3 * len(state.ok_ids)
        run_job(cfg, loaded=loaded)
        assert sample_rows(out) == expected, f"seed {seed}: the resumed output differs from the uninterrupted run"
    assert num_interrupted and num_partials, "no signal landed while samples were in flight"



KILL_ROWS = 48


@pytest.fixture(scope="module")
def kill_setup(tmp_path_factory):
    """The kill harness's tiny model directory and input, the job's flags with --n 3, and the
    uninterrupted output by (id, sample_index)."""
    fixture = kill_harness.make_fixture(tmp_path_factory.mktemp("kill"), KILL_ROWS)
    flags = dict(id_column="id", device="cpu", dtype="float32", max_new_tokens=kill_harness.MAX_NEW_TOKENS,
                 kv_cache_memory="16MiB", batch_size=16, commit_every_rows=2, n=3, temperature=1.0, seed=5,
                 quiet=True)
    model = load_model(str(fixture.model_dir), device="cpu", dtype="float32")

    def config_for(out):
        return build_config(None, inputs=[str(fixture.src)], output=str(out), model=str(fixture.model_dir), **flags)

    reference_out = tmp_path_factory.mktemp("kill-ref") / "out"
    started = time.monotonic()
    run_job(config_for(reference_out), loaded=model)
    args = ["--n", "3", "--temperature", "1.0", "--seed", "5"]
    return fixture, sample_rows(reference_out), config_for, model, args, time.monotonic() - started


@pytest.mark.soak
def test_kill_9_then_resume_writes_every_sample_exactly_once(tmp_path, kill_setup, one_thread):
    """A `python -m batchgen run --n 3` subprocess SIGKILLed after its first commit, then resumed:
    only whole rows are committed before the kill, every (id, sample) once after the resume."""
    fixture, reference, config_for, model, extra, reference_s = kill_setup
    num_partial = 0
    for seed in range(3):
        out = tmp_path / f"seed-{seed}"
        args = kill_harness.job_args(fixture, out)
        args[args.index("--commit-every") + 1] = "2"  # as config_for: a commit every 2 rows (6 output rows)
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", *args, *extra],
                                env={**os.environ, **kill_harness.JOB_ENV}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        with kill_harness.reaped(proc):
            if kill_harness.wait_until_a_part(proc, out):
                time.sleep(random.Random(seed).uniform(0.0, 0.3) * reference_s)  # within what is left to run
                kill_harness.sigkill(proc)
            proc.wait()
        state = load_manifest(out)
        committed = sample_rows(out) if any(out.glob("part-*.parquet")) else {}
        # A kill between an entry and its renames leaves a committed part under its temp name until
        # recovery publishes it (roll forward): the visible rows are the published parts' rows, each
        # with all its samples.
        published = {i for r in state.parts.values() if (out / r.name).exists() for i in r.ids}
        assert published <= state.ok_ids
        assert sorted(committed) == sorted((i, s) for i in published for s in range(3))  # whole rows only
        assert all(committed[key] == reference[key] for key in committed)
        num_partial += 0 < len(state.ok_ids) < KILL_ROWS
        run_job(config_for(out), loaded=model)
        assert sample_rows(out) == reference
    assert num_partial, "no kill landed on a half-written output"
