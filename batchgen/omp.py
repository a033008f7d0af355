"""OpenMP's wait policy, chosen before torch loads libgomp (which reads it once, at load).

libgomp's default makes a thread that reaches the end of a parallel region spin for ~300k
iterations before it sleeps. On cores of its own that saves a wake-up per region; on a machine
shared with anything else (a cron box, an Airflow worker, a CI runner) the spinning threads take
the time slices the working thread needs, and every barrier waits for a descheduled thread:
`benchmarks/threads.py` measured batchgen's forward 4-5x slower with one busy neighbour. With
OMP_WAIT_POLICY=PASSIVE idle threads sleep at once; see README ("Threads") for the measured cost
on a quiet machine.

The `batchgen` command calls `apply_defaults()` before anything imports torch. A user's own
OMP_WAIT_POLICY or GOMP_SPINCOUNT wins; BATCHGEN_OMP_DEFAULTS=0 leaves libgomp's default.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
_USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the defaults that the user has not set; return what was set."""
    if environ.get("BATCHGEN_OMP_DEFAULTS", "1") == "0" or any(k in environ for k in _USER_KEYS):
        return {}
    if "torch" in sys.modules:  # libgomp is loaded and has read its settings: too late to matter
        return {}
    environ.update(DEFAULTS)
    return dict(DEFAULTS)
