"""Compute threads that follow the cores the machine leaves us, re-checked as the job runs.

On a CPU, every parallel region of the forward ends at a barrier, so one compute thread that
shares its core with another process holds up all of them: beside a busy neighbour fewer threads
generate more, while on a quiet machine every core helps (`benchmarks/end_to_end/threads.py`). So every
`interval_s` the governor reads how much CPU the *other* processes took (all busy time from
/proc/stat minus our own) and runs on the cores they leave, between 1 and the thread count the
engine started with. Linux only; elsewhere it does nothing.

It gives cores up at once and takes them back slowly: fewer threads as soon as one interval (1 s)
shows a neighbour, more only once every interval of the last `raise_after_s` (5 s) left room.
Where the job started on a quiet machine its idle threads spin at barriers (batchgen/runtime/omp.py), and
two spinning threads beside a busy neighbour run several times slower than one, so a neighbour
that arrives mid-job must be noticed within a second, not after a slow check.

While idle threads spin (batchgen/runtime/omp.py), niced processes count as neighbours too: a time slice
the scheduler gives one stalls every barrier our threads meet.

It is on when the user did not pin threads (OMP_NUM_THREADS unset); an explicit thread count wins.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from collections.abc import Callable

import torch

from batchgen.runtime import omp
from batchgen.runtime.cpuload import cpu_seconds, other_cores_between

log = logging.getLogger(__name__)

_base_threads: int | None = None  # the thread count before any governor changed it
_last_set: int | None = None  # what a governor last set, so a later engine starts from the base


def _remember(num_threads: int) -> None:
    global _last_set
    _last_set = num_threads


class ThreadGovernor:
    def __init__(self, max_threads: int, interval_s: float = 1.0, raise_after_s: float = 5.0,
                 read: Callable[[], tuple[float, float] | None] = cpu_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.raise_after_s = raise_after_s
        self._targets: collections.deque[tuple[float, int]] = collections.deque()  # (time, cores left)
        self._read, self._clock, self._set = read, clock, set_threads
        self.num_threads = max_threads
        self._t0 = clock()
        self._last = read()
        self.num_changes = 0

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """A governor for CPU engines whose thread count the user left alone; else None."""
        global _base_threads
        if device.type != "cpu" or "OMP_NUM_THREADS" in os.environ or cpu_seconds() is None:
            return None
        current = torch.get_num_threads()
        if _base_threads is None or current != _last_set:
            # the count the process runs with, unless an earlier engine's governor lowered it
            _base_threads = current
        if _base_threads <= 1:
            return None
        if omp.threads_spin():  # a niced neighbour's slices stall spinning barriers: count its time
            return cls(_base_threads, read=functools.partial(cpu_seconds, count_niced=True))
        return cls(_base_threads, read=cpu_seconds)

    def tick(self) -> None:
        """Call once per step; re-checks the machine every `interval_s`."""
        now = self._clock()
        if now - self._t0 < self.interval_s:
            return
        sample = self._read()
        if sample is None or self._last is None:
            return
        other_cores = other_cores_between(self._last, sample, now - self._t0)
        self._t0, self._last = now, sample
        # a neighbour that keeps at least half a core busy takes that core from us
        room = max(1, min(self.max_threads, self.max_threads - int(other_cores + 0.5)))
        self._targets.append((now, room))
        while self._targets[0][0] < now - self.raise_after_s:
            self._targets.popleft()
        # down at once; up only as far as every check of the last raise_after_s allowed
        target = room if room < self.num_threads else min(t for _, t in self._targets)
        if target != self.num_threads:
            log.debug("engine: %d compute thread%s (other processes keep %.1f cores busy)", target,
                      "" if target == 1 else "s", other_cores)
            self._set(target)
            self.num_threads = target
            _remember(target)
            self.num_changes += 1
