"""The C heap between steps and commits: freed pages kept for the next step, returned after a commit.

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

`keep_freed_pages` is the other half. A forward step allocates and frees its activations (a few
MiB to a few hundred, with the row count) every step. glibc serves a request above its mmap
threshold (at most 32 MiB, adjusted as it goes) with a fresh mapping and unmaps it on free, and it
gives the heap's free top back on every free past its trim threshold: so the next step's
activations fault their pages in again, each page zeroed by the kernel: on a prefill-heavy CPU
job, a share of the process's CPU time worth measuring
(benchmarks/results/2026-12-04-structured-speed.md). Raising both thresholds keeps freed blocks in
the heap for the next step; what a job's working set leaves behind between steps is still returned
by `HeapTrimmer` after each commit (vLLM-CPU's deployments get the same from preloading tcmalloc).
The CLI sets it for the commands that run a model; a user's own glibc thresholds win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from collections.abc import MutableMapping

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# a step's largest activations (a 2048-token chunk of a large model's MLP, or logits over a big
# vocabulary) stay below this, so they come from the heap; only bigger blocks (weights, a KV cache)
# get their own mapping
MMAP_THRESHOLD_BYTES = 1 << 30
# free() never shrinks the heap on its own; HeapTrimmer does, between commits
TRIM_THRESHOLD_BYTES = 1 << 30
# the user's own choice of either threshold wins: glibc's variables, or its tunables
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
SWITCH = "BATCHGEN_HEAP_DEFAULTS"  # "0": glibc's own thresholds

TRIM_EVERY_S = 2.0  # rare enough to cost a negligible share of the job; the RSS between two trims grows back a little


def libc_function(name: str):
    """The C library's function `name` (ctypes, argument and result types unset), or None where
    there is no such library or function (not glibc, or an older one)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _typed_libc_function(name: str, argtypes: tuple, restype):
    """`libc_function(name)` with its argument and result types set, once per process; or None."""
    fn = libc_function(name)
    if fn is not None:
        fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _malloc_trim():
    return _typed_libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def _mallopt():
    return _typed_libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)


def keep_freed_pages(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Keep freed blocks in the heap instead of unmapping them (see the module docstring); False
    where the user set either threshold, BATCHGEN_HEAP_DEFAULTS=0, or there is no mallopt."""
    if environ.get(SWITCH, "1") == "0" or any(name in environ for name in USER_VARIABLES):
        return False
    if any(tunable in environ.get("GLIBC_TUNABLES", "") for tunable in USER_TUNABLES):
        return False
    fn = _mallopt()
    if fn is None:
        return False
    return bool(fn(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) & bool(fn(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


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
