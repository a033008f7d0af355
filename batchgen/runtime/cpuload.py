"""How much CPU the machine's *other* processes take, from /proc/stat (Linux; no torch import).

Shared by the OpenMP wait-policy choice the CLI makes before torch loads (batchgen/runtime/omp.py) and
the engine's thread governor (runtime/threads.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# /proc/stat's cpu line: user nice system idle iowait irq softirq steal. Time of niced processes
# (field 1) is counted only when asked (cpu_seconds' count_niced): the kernel gives them only the
# slices we leave, so they do not take a core from threads that sleep while they wait.
_BUSY_FIELDS = (0, 2, 5, 6, 7)
_NICE_FIELD = 1


def num_cpu_cores() -> int:
    """The cores this process may run on (its affinity mask; os.cpu_count() off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_seconds(count_niced: bool | None = None) -> tuple[float, float] | None:
    """(busy seconds of the whole machine, this process's CPU seconds), or None off Linux.

    count_niced: whether niced processes' time counts as busy; None: only when we run niced
    ourselves. Spinning OpenMP threads need True: every slice a niced process gets stalls a barrier."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    if count_niced is None:
        count_niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
    counted = (*_BUSY_FIELDS, _NICE_FIELD) if count_niced else _BUSY_FIELDS
    busy = sum(int(fields[i]) for i in counted if i < len(fields)) / ticks
    t = os.times()
    return busy, t.user + t.system


def other_cores(window_s: float, read: Callable[[], tuple[float, float] | None] = cpu_seconds,
                sleep: Callable[[float], None] = time.sleep) -> float | None:
    """Cores the other processes kept busy over the next `window_s` seconds, or None off Linux."""
    first = read()
    if first is None:
        return None
    sleep(window_s)
    second = read()
    return None if second is None else other_cores_between(first, second, window_s)


def other_cores_between(first: tuple[float, float], second: tuple[float, float], wall_s: float) -> float:
    """Cores the other processes kept busy between two cpu_seconds() samples `wall_s` apart."""
    return max(0.0, (second[0] - first[0]) - (second[1] - first[1])) / wall_s


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """Cores this process's cgroup may use (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or None
    when unlimited or unknown. A container's CPU limit (Kubernetes' `limits.cpu`) shows up here,
    not in the affinity mask, which still lists every core of the node."""
    for quota_file, period_file in ((f"{root}/cpu.max", None),
                                    (f"{root}/cpu/cpu.cfs_quota_us", f"{root}/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as f:
                parts = f.read().split()
            if period_file is not None:
                with open(period_file) as f:
                    parts = [parts[0], f.read().strip()]
        except (OSError, IndexError):
            continue
        if len(parts) < 2 or parts[0] in ("max", "-1"):
            return None
        try:
            quota, period = int(parts[0]), int(parts[1])
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None
    return None
