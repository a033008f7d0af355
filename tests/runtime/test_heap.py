"""Returning the C heap's free pages between commits (batchgen/runtime/heap.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.runtime import heap

FRAGMENTED = """
import ctypes, json
from batchgen.runtime.heap import trim_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
blocks = [libc.malloc(64 << 10) for _ in range(2048)]  # 128 MiB below the mmap threshold: the heap
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:  # the last one stays, so free() cannot shrink the heap from its top
    libc.free(b)
before = rss_mib()
trimmed = trim_heap()
print(json.dumps([before, rss_mib(), trimmed]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_returns_free_pages_inside_the_heap():
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, check=True)
    before, after, trimmed = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    if not trimmed:
        pytest.skip("not glibc: no malloc_trim")
    assert before - after > 100, (before, after)  # ~127 MiB freed in the middle of the heap


def test_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)
    now = [100.0]
    trimmer = heap.HeapTrimmer(every_s=2.0, clock=lambda: now[0])
    assert trimmer.maybe_trim()  # the first commit trims
    now[0] += 1.9
    assert not trimmer.maybe_trim()
    now[0] += 0.2
    assert trimmer.maybe_trim()
    assert len(calls) == trimmer.num_trims == 2
