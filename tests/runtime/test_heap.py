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


REUSE = """
import ctypes, json, resource, sys
from batchgen.runtime.heap import keep_freed_pages
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
kept = keep_freed_pages({}) if sys.argv[1] == "kept" else False
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):  # a step's activations: 48 MiB and 24 MiB, allocated, written, freed
    big, small = libc.malloc(48 << 20), libc.malloc(24 << 20)
    ctypes.memset(big, 1, 48 << 20)
    ctypes.memset(small, 1, 24 << 20)
    libc.free(big)
    libc.free(small)
print(json.dumps([kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_pages_are_not_faulted_in_again_each_step():
    def faults(mode: str) -> tuple[bool, int]:
        out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True)
        return tuple(__import__("json").loads(out.stdout.strip().splitlines()[-1]))

    kept, kept_faults = faults("kept")
    if not kept:
        pytest.skip("not glibc: no mallopt")
    _, default_faults = faults("default")
    pages_per_step = (72 << 20) // 4096
    assert default_faults > 6 * pages_per_step  # every step faults its 72 MiB in again
    assert kept_faults < 2 * pages_per_step  # the first step's pages serve the others


def test_a_users_thresholds_win():
    assert not heap.keep_freed_pages({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert not heap.keep_freed_pages({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert not heap.keep_freed_pages({heap.SWITCH: "0"})


def test_the_run_command_keeps_freed_pages(monkeypatch):
    from batchgen import cli

    calls = []
    monkeypatch.setattr(heap, "keep_freed_pages", lambda: calls.append(1) or True)
    for name in ("app", "catch_interrupts"):
        monkeypatch.setattr(cli, name, lambda: None)
    monkeypatch.setattr(cli.omp, "apply_defaults", lambda **_: None)  # process-wide: not in pytest's
    monkeypatch.setattr(cli.onednn_cache, "apply_defaults", lambda: None)
    for argv in (["batchgen", "run", "--input", "x"], ["batchgen", "status", "out"]):
        monkeypatch.setattr(sys, "argv", argv)
        cli.main()
    assert calls == [1]  # `run` only; `status` runs no model
