"""OpenMP's wait policy, chosen before torch loads libgomp (which reads it once, at load).

Every op of the forward is a parallel region that ends at a barrier: some 600 a decode step.
libgomp's default makes a thread that reaches a barrier spin (~300k iterations) before it sleeps,
so the next region finds it awake; OMP_WAIT_POLICY=PASSIVE makes it sleep at once, and every
region then pays a wake-up. The two sides of that choice:
  - on a quiet machine the wake-ups are a real share of a step, so spin-wait generates more;
  - beside a busy process, spinning threads take the time slices the working thread needs and
    every barrier waits for a descheduled thread, so spin-wait is far slower than passive.
(`benchmarks/end_to_end/threads.py` measures both; docs/performance.md has the figures.)
So `apply_defaults` looks at the machine for SAMPLE_WINDOW_S before torch loads: when the other
processes keep at least BUSY_CORES of a core busy, or a cgroup CPU limit (a container's
`limits.cpu`) is below the cores torch would use, idle threads sleep (PASSIVE); otherwise
libgomp's spin-wait stays. Niced processes count here: the time slices the scheduler still gives
them stall a spinning barrier, so beside heavy niced work a spinning job's steps take many times
their passive length. A neighbour that
arrives later is the thread governor's (runtime/threads.py): it drops the compute threads to the
cores left, counting niced processes too while threads spin, and one thread has no barrier to
spin at.

The `batchgen` command calls `apply_defaults()` before anything imports torch. A user's own
OMP_WAIT_POLICY or GOMP_SPINCOUNT wins; BATCHGEN_OMP_DEFAULTS=0 leaves libgomp's default; the
choice is inherited by the processes of `--workers`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping

from batchgen.runtime import cpuload

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
_USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SAMPLE_WINDOW_S = 0.15
BUSY_CORES = 0.5  # a neighbour keeping half a core busy shares our cores

# why the policy is what it is, for the job's log (jobs read it once torch is loaded)
choice_reason: str | None = None


def threads_spin(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether libgomp's idle threads spin in this process (it read the environment at load)."""
    return environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE" and environ.get("GOMP_SPINCOUNT") != "0"


def choose(num_cores: int, other_cores: float | None, cgroup_cores: float | None) -> tuple[dict[str, str], str]:
    """The environment to set (empty: libgomp's spin-wait) and the reason, from the machine's state."""
    if cgroup_cores is not None and cgroup_cores < num_cores:
        return PASSIVE, (f"passive wait: the cgroup allows {cgroup_cores:g} of {num_cores} cores, "
                         "and spinning threads would spend that quota")
    if other_cores is None:
        return PASSIVE, "passive wait: the machine's load cannot be read (no /proc/stat)"
    if other_cores >= BUSY_CORES:
        return PASSIVE, f"passive wait: other processes keep {other_cores:.1f} cores busy"
    return {}, f"spin-wait: other processes keep {other_cores:.2f} cores busy"


def apply_defaults(environ: MutableMapping[str, str] = os.environ, *, sample: bool = True,
                   measure: Callable[[], float | None] | None = None,
                   cgroup: Callable[[], float | None] = cpuload.cgroup_cpu_limit) -> dict[str, str]:
    """Choose the wait policy unless the user has; set it in `environ`; return what was set.
    `sample=False` (a command that generates nothing: status, compact, --help) sets PASSIVE without
    spending the sampling window."""
    global choice_reason
    if environ.get("BATCHGEN_OMP_DEFAULTS", "1") == "0" or any(k in environ for k in _USER_KEYS):
        choice_reason = "set by the user's environment"
        return {}
    if "torch" in sys.modules:  # libgomp is loaded and has read its settings: too late to matter
        return {}
    num_cores = cpuload.num_cpu_cores()
    if "OMP_NUM_THREADS" in environ:
        try:
            num_cores = min(num_cores, max(1, int(environ["OMP_NUM_THREADS"].split(",")[0])))
        except ValueError:
            pass
    if num_cores <= 1:  # one thread meets no other at a barrier: nothing to choose
        choice_reason = "one compute thread"
        return {}
    if not sample:
        choice_reason = "passive wait: a command that generates nothing"
        environ.update(PASSIVE)
        return dict(PASSIVE)
    if measure is None:
        def measure():
            return cpuload.other_cores(SAMPLE_WINDOW_S, read=lambda: cpuload.cpu_seconds(count_niced=True))
    chosen, choice_reason = choose(num_cores, measure(), cgroup())
    environ.update(chosen)
    return dict(chosen)
