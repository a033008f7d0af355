"""CPU time that OTHER processes took during a timed region (Linux /proc).

On a shared machine a busy sibling core slows our OpenMP steps several-fold, so every timed run
records how much CPU the rest of the machine used meanwhile:

    with measure() as load:
        run()
    load.other_cpu_s   # busy CPU seconds of every other process during run()

busy = user + nice + system + irq + softirq + steal from the aggregate `cpu` line of /proc/stat
(guest time is already inside user); ours = utime + stime (+ waited-for children) from
/proc/self/stat, which sums all our threads. Resolution is one clock tick (10 ms); elsewhere
than Linux the fields are None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal


@dataclass(slots=True)
class LoadRecord:
    wall_s: float = 0.0
    busy_cpu_s: float | None = None  # every process, every core
    own_cpu_s: float | None = None  # this process and its waited-for children
    other_cpu_s: float | None = None  # busy - own: what the rest of the machine took
    num_cpus: int = os.cpu_count() or 1

    @property
    def other_cores(self) -> float | None:
        """Mean number of cores the other processes kept busy (0 = a quiet machine)."""
        if self.other_cpu_s is None or self.wall_s <= 0:
            return None
        return self.other_cpu_s / self.wall_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["other_cores"] = None if self.other_cores is None else round(self.other_cores, 3)
        for k in ("wall_s", "busy_cpu_s", "own_cpu_s", "other_cpu_s"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        return d


def _ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) / _ticks_per_s()


def own_cpu_s() -> float | None:
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: fields start after the last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])  # fields 14-17 of proc(5)
    return (utime + stime + cutime + cstime) / _ticks_per_s()


@contextmanager
def measure() -> Iterator[LoadRecord]:
    record = LoadRecord()
    busy0, own0, t0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
    try:
        yield record
    finally:
        record.wall_s = time.perf_counter() - t0
        busy1, own1 = busy_cpu_s(), own_cpu_s()
        if None not in (busy0, own0, busy1, own1):
            record.busy_cpu_s = busy1 - busy0
            record.own_cpu_s = own1 - own0
            # tick rounding in the two sources can make a quiet machine read slightly negative
            record.other_cpu_s = max(0.0, record.busy_cpu_s - record.own_cpu_s)
