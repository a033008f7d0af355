"""Run one batchgen command from an Airflow task, and tell Airflow whether a retry can help.

batchgen's exit codes (batchgen/errors.py) split into two kinds for a scheduler:

    2        a usage, config or input error: the same command fails the same way, so the task
             fails at once (AirflowFailException) instead of burning its retries and delay
    others   1 (a crash), 3 (too many error rows; a rerun regenerates them), 4 (finalize: a shard
             is missing), 130/143 (interrupted; a rerun resumes): worth a retry

No Airflow import here, so the rule is tested without Airflow (tests/examples/test_batchgen_task.py):
the DAG passes its exception classes in.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

NO_RETRY_EXIT_CODES = frozenset({2})
STOP_GRACE_SECONDS = 60  # after Airflow stops the task: batchgen commits and exits within its own 25 s


def run_batchgen(command: Sequence[str], *, fail: type[Exception], retry: type[Exception]) -> None:
    """Run `command`, its output into the task's log as it comes; raise `fail` for an exit code a
    retry cannot change, `retry` for any other failure."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
        code = proc.wait()
    except BaseException:  # Airflow stopping the task (timeout, a cleared run): batchgen commits, exits 143
        proc.terminate()
        proc.wait(timeout=STOP_GRACE_SECONDS)
        raise
    if code in NO_RETRY_EXIT_CODES:
        raise fail(f"{command[0]} {command[1]} exited {code}: a usage, config or input error (its line is above); "
                   "a retry would fail the same way, so the task fails now")
    if code != 0:
        raise retry(f"{command[0]} {command[1]} exited {code}")
