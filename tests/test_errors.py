"""Exit codes stay scheduler-friendly: none is 99, which Airflow's BashOperator reads as "skip the task"."""

from __future__ import annotations

import inspect
import signal

import batchgen.errors as errors

AIRFLOW_SKIP = 99  # BashOperator's default skip_on_exit_code


def _error_classes():
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.BatchgenError)]


def test_no_error_exits_99_and_every_error_exits_non_zero():
    codes = {c.__name__: c.exit_code for c in _error_classes()}
    assert codes["ShardsIncomplete"] == 4 and codes["ShardsMismatch"] == 2
    assert AIRFLOW_SKIP not in codes.values() and 0 not in codes.values(), codes


def test_interrupts_exit_128_plus_the_signal_never_99():
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        code = errors.JobInterrupted(signum).exit_code
        assert code == 128 + signum and code not in (0, AIRFLOW_SKIP)
