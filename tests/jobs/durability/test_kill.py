"""kill -9 at random moments, then resume: exactly-once output equal to an uninterrupted run.

NUM_SEEDS subprocess jobs (`python -m batchgen run`, 240 rows, tiny random Llama, --commit-every 8)
are SIGKILLed after a random delay drawn over the window from taking the lock to writing
_SUCCESS, two at a time; each is then resumed to completion in-process. The cycle itself lives in
tests/jobs/kill_harness.py; benchmarks/soaks/soak_kill.py runs it for 100+ seeds and several kills per seed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from batchgen.config.job import build_config
from batchgen.engine.model.loader import load_model
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.run import run_job
from tests.jobs.kill_harness import (
    COMMIT_EVERY,
    MAX_NEW_TOKENS,
    check_committed,
    check_final,
    kill_cycle,
    make_fixture,
    timed_reference,
)

pytestmark = pytest.mark.soak  # kills, signals, fault injection or a local S3 server

NUM_SEEDS = 20
NUM_ROWS = 240


def resume_config(fixture, out):
    """The same job as kill_harness.job_args, as a JobConfig."""
    return build_config(None, inputs=[str(fixture.src)], output=str(out), model=str(fixture.model_dir),
                        id_column="id", device="cpu", dtype="float32", max_new_tokens=MAX_NEW_TOKENS,
                        kv_cache_memory="16MiB", batch_size=16, commit_every_rows=COMMIT_EVERY, quiet=True)


def test_kill_9_at_random_moments_then_resume(tmp_path, one_thread):
    fixture = make_fixture(tmp_path, NUM_ROWS)
    reference, window_s, first_part_s = timed_reference(fixture, tmp_path / "reference")
    assert sorted(reference) == list(range(NUM_ROWS))
    loaded = load_model(str(fixture.model_dir), device="cpu", dtype="float32")

    def cycle(seed):
        # even seeds: anywhere in the job (start-up included); odd seeds: after the job's own first
        # part, within what the reference had left to run, so that half the kills surely land on a
        # half-written output however long the model takes to load and however loaded the machine
        if seed % 2 == 0:
            return kill_cycle(fixture, tmp_path / f"seed-{seed}", seed, kills=1, max_delay_s=window_s)
        return kill_cycle(fixture, tmp_path / f"seed-{seed}", seed, kills=1,
                          max_delay_s=max(window_s - first_part_s, 0.05), after_first_part=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(cycle, range(NUM_SEEDS)))

    for result in results:
        out = tmp_path / f"seed-{result.seed}"
        committed = check_committed(out)
        summary = run_job(resume_config(fixture, out), loaded=loaded)
        assert summary.num_rows_skipped == len(committed)
        assert summary.num_rows + summary.num_rows_skipped == NUM_ROWS
        check_final(out, fixture, reference, result)
        state = load_manifest(out)
        state.check_integrity()
        assert sorted(p.name for p in out.glob("part-*.parquet")) == sorted(state.parts)
        assert check_committed(out) == set(range(NUM_ROWS))  # every committed part readable, checksums match
        assert not list(out.glob(".*"))
        rerun = run_job(resume_config(fixture, out), loaded=loaded)
        result.rerun_rows = rerun.num_rows
        assert (result.rows_lost, result.rows_duplicated, result.rows_missing, result.rows_wrong,
                result.rerun_rows) == (0, 0, 0, 0, 0), result

    kills = [r for r in results if r.kills]
    partial = [r for r in kills if 0 < r.committed_at_kill[0] < NUM_ROWS]
    # Even seeds' delays span the whole window (a kill may land before the first commit or after the
    # last); odd seeds' start at the reference's first part. Enough must hit a half-written output.
    assert len(kills) >= NUM_SEEDS // 2, [(r.kill_delays_s, r.committed_at_kill) for r in results]
    assert len(partial) >= NUM_SEEDS // 4, [(r.kill_delays_s, r.committed_at_kill) for r in results]
