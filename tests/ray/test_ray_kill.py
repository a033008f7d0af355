"""kill -9 of a Ray job's driver mid-way, then resume: every row exactly once, equal to a local run.

`python -m batchgen run --executor ray` (its own local Ray, 2 actors) is SIGKILLed once it has
committed some rows and before it finishes. Then: what it committed is intact (checksums, no
duplicate ids), a resumed Ray run skips exactly the committed rows and ends with the uninterrupted
run's rows, and the Ray processes the killed driver started have ended (Ray's reaper ends them with
their driver; its agents follow within a minute or two). Both generating stages: the default Ray Data
actor pool, and the kept-warm engines (--ray-keep-warm: detached actors, which end with that Ray too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

import batchgen.ray
from batchgen.io.manifest.manifest import load_manifest
from tests.jobs.durability.test_kill import resume_config
from tests.jobs.kill_harness import (
    JOB_ENV,
    SeedResult,
    check_committed,
    check_final,
    job_args,
    make_fixture,
    read_output,
    reaped,
    sigkill,
)

pytestmark = pytest.mark.soak  # kills, signals, fault injection or a local S3 server

NUM_ROWS = 160
TIMEOUT_S = 480.0  # Ray's start and two actors' imports, on a busy 2-core machine


def wait_for_first_commit(proc: subprocess.Popen, out, log) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before its first commit: {tail(log)}"
        if (out / "_manifest").is_dir():
            committed = load_manifest(out).num_committed_rows
            if committed:
                return committed
        time.sleep(0.01)
    raise TimeoutError(f"no commit within {TIMEOUT_S} s; the job's log ends: {tail(log)}")


def tail(log) -> str:
    return log.read_text(errors="replace")[-3000:]


@pytest.mark.parametrize("keep_warm_s", [0.0, 30.0], ids=["actor-pool", "keep-warm"])
def test_kill_9_of_the_driver_then_resume_writes_every_row_once(tmp_path, loaded, keep_warm_s):
    fixture = make_fixture(tmp_path, NUM_ROWS)
    from batchgen.jobs.commands.run import run_job

    run_job(resume_config(fixture, tmp_path / "reference"), loaded=loaded)
    reference = read_output(tmp_path / "reference")
    out = tmp_path / "out"
    log = tmp_path / "job.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", *job_args(fixture, out), "--executor",
                                 "ray", "--ray-actors", "2", "--ray-keep-warm", str(keep_warm_s)],
                                env={**os.environ, **JOB_ENV}, stdout=subprocess.DEVNULL, stderr=stderr)
    with reaped(proc):
        wait_for_first_commit(proc, out, log)
        ray_processes = psutil.Process(proc.pid).children(recursive=True)
        sigkill(proc)
    committed = check_committed(out)
    assert 0 < len(committed) < NUM_ROWS and not (out / "_SUCCESS").exists()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = batchgen.ray.run(resume_config(fixture, out).replace(ray_keep_warm_s=keep_warm_s), num_actors=2)
    finally:
        ray.shutdown()
    assert summary.num_rows_skipped == len(committed)
    assert summary.num_rows + summary.num_rows_skipped == NUM_ROWS
    result = SeedResult(0)
    check_final(out, fixture, reference, result)
    assert (result.rows_duplicated, result.rows_missing, result.rows_wrong) == (0, 0, 0)
    assert check_committed(out) == set(range(NUM_ROWS))
    # checked last, so the resume's minutes count: the node's agents notice a dead raylet slowly
    _, alive = psutil.wait_procs(ray_processes, timeout=120)
    assert not alive, f"Ray processes outlived their driver: {[(p.pid, p.name()) for p in alive]}"
