"""Hand the C heap's free pages back to the system between commits (glibc's malloc_trim).

The CPU linear layers' kernels are built and evicted all job long (batchgen/runtime/onednn_cache.py caps
how many are kept): each step meets new row counts, and each new kernel's JIT code and descriptors
are allocated as an evicted one's are freed. glibc keeps what is freed inside its heap for reuse,
and kernels of many sizes between live objects fragment it, so the heap's free bytes, counted in
RSS, grew over a job's first parts while the bytes in use stayed flat
(benchmarks/results/2026-12-02-scale-rows.md). `malloc_trim(0)` returns every whole free page
anywhere in the heap (madvise), not only the top. It walks the whole heap, so it is not free
(benchmarks/kernels/kernel_cache.py times it): the job calls it after a commit
(batchgen.jobs.durability.commit_schedule), at most once per TRIM_EVERY_S.

A no-op where the C library is not glibc (musl, macOS): `trim_heap` then returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time

TRIM_EVERY_S = 2.0  # rare enough to cost a negligible share of the job; the RSS between two trims grows back a little


def libc_function(name: str):
    """The C library's function `name` (ctypes, argument and result types unset), or None where
    there is no such library or function (not glibc, or an older one)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _malloc_trim():
    fn = libc_function("malloc_trim")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return the C heap's free pages to the system now; False where there is no malloc_trim."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


class HeapTrimmer:
    """`maybe_trim()` trims at most once per `every_s` seconds (the first call trims)."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock=time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self.last: float | None = None
        self.num_trims = 0

    def maybe_trim(self) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            return False
        self.last = now
        trimmed = trim_heap()
        self.num_trims += trimmed
        return trimmed
