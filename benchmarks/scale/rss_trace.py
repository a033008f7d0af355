"""Where does a job's memory go? Its RSS over time, beside Arrow's and glibc's own counts.

    python -m benchmarks.scale.scale_rows --rows 10000 1000000 --no-kill --trace-rss --keep-logs DIR
    python -m benchmarks.scale.rss_trace DIR/run-10000-0.trace.jsonl DIR/run-1000000-0.trace.jsonl

`start` (called inside the job's process by scale_rows' child when BATCHGEN_RSS_TRACE names a
file) runs a daemon thread that every 0.2 s appends one JSON line:

    t            unix time
    rss, anon, file, hwm   /proc/self/status VmRSS, RssAnon, RssFile, VmHWM (KiB)
    arrow        pa.total_allocated_bytes(): live bytes in Arrow's default pool (its backend: `pool`)
    heap, mmap, used, free  glibc mallinfo2 over every arena: arena bytes (brk + arena heaps),
                 mmapped bytes, bytes in use, free bytes kept (what malloc_trim could return)
    blocks       sys.getallocatedblocks(): live Python objects' blocks
    parts        committed part files in the output directory so far (rows = parts x rows per part)

and at exit one line with "exit": true, the most numerous gc-tracked types (a leak of Python
objects shows there). The summary prints, per trace, those figures when the job had committed
0, 10, 25, 50, 75 and 100% of its parts, and at the RSS peak: a peak that climbs with `parts`
while `arrow` and `used` stay flat is the allocators keeping freed memory, not live data.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from batchgen.runtime.heap import libc_function

ENV_VAR = "BATCHGEN_RSS_TRACE"
EVERY_S = 0.2
_STATUS_KEYS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "hwm"}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    """glibc's mallinfo2 (2.33+), or None elsewhere."""
    fn = libc_function("mallinfo2")
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return fn


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _STATUS_KEYS:
                out[_STATUS_KEYS[key]] = int(value.split()[0])
    return out


def _count_parts(out_dir: str | None) -> int | None:
    if out_dir is None:
        return None
    try:
        return sum(1 for name in os.listdir(out_dir) if name.startswith("part-"))
    except OSError:
        return None


def sample(out_dir: str | None, mallinfo=None) -> dict:
    row: dict = {"t": round(time.time(), 3), **_status(), "blocks": sys.getallocatedblocks(),
                 "parts": _count_parts(out_dir)}
    if "pyarrow" in sys.modules:  # not imported by the tracer: the job imports it when it does
        import pyarrow as pa

        row["arrow"] = pa.total_allocated_bytes()
    if mallinfo is not None:
        m = mallinfo()
        row.update(heap=m.arena, mmap=m.hblkhd, used=m.uordblks + m.hblkhd, free=m.fordblks)
    return row


def start(path: str | Path, out_dir: str | None) -> None:
    """Trace this process into `path` until it exits (a daemon thread, and an atexit line)."""
    import atexit

    f = open(path, "w", buffering=1)  # noqa: SIM115 - open for the process' life; line-buffered
    mallinfo = _mallinfo2()
    stop = threading.Event()
    lock = threading.Lock()

    def loop() -> None:
        while not stop.wait(EVERY_S):
            row = sample(out_dir, mallinfo)
            with lock:
                if not f.closed:
                    f.write(json.dumps(row) + "\n")

    def at_exit() -> None:
        stop.set()
        row = sample(out_dir, mallinfo)
        row["exit"] = True
        if "pyarrow" in sys.modules:
            import pyarrow as pa

            row["pool"] = pa.default_memory_pool().backend_name
            row["arrow_max"] = pa.default_memory_pool().max_memory()
        row["gc_types"] = Counter(type(o).__qualname__ for o in gc.get_objects()).most_common(25)
        with lock:
            f.write(json.dumps(row) + "\n")
            f.close()

    atexit.register(at_exit)
    threading.Thread(target=loop, name="rss-trace", daemon=True).start()


def read_trace(path: Path) -> tuple[list[dict], dict | None]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    end = rows[-1] if rows and rows[-1].get("exit") else None
    return [r for r in rows if not r.get("exit")], end


def _mib(kib_or_bytes: int | None, *, kib: bool) -> str:
    if kib_or_bytes is None:
        return "-"
    return f"{kib_or_bytes / (1024 if kib else 1 << 20):.1f}"


def summarize(path: Path) -> list[str]:
    rows, end = read_trace(path)
    if not rows:
        return [f"{path}: empty"]
    total = max((r["parts"] or 0) for r in rows)
    picks: list[tuple[str, dict]] = []
    before = [r for r in rows if not r["parts"]]
    if before:
        picks.append(("before part 1 (peak)", max(before, key=lambda r: r["rss"])))
    for frac in (0.1, 0.25, 0.5, 0.75, 1.0):
        hit = next((r for r in rows if (r["parts"] or 0) >= frac * total), None)
        if hit is not None and total:
            picks.append((f"{frac:.0%} of parts", hit))
    peak = max(rows, key=lambda r: r["rss"])
    picks.append(("RSS peak", peak))
    t0 = rows[0]["t"]
    out = [f"{path.name}: {len(rows)} samples over {rows[-1]['t'] - t0:.0f} s, {total} parts",
           f"{'when':>22} {'t s':>6} {'parts':>6} {'rss':>7} {'anon':>7} {'file':>6} {'arrow':>7} {'heap':>7} "
           f"{'mmap':>6} {'used':>7} {'free':>7} {'blocks':>9}   (MiB)"]
    for label, r in picks:
        out.append(f"{label:>22} {r['t'] - t0:6.1f} {r['parts'] or 0:6d} {_mib(r['rss'], kib=True):>7} "
                   f"{_mib(r.get('anon'), kib=True):>7} {_mib(r.get('file'), kib=True):>6} "
                   f"{_mib(r.get('arrow'), kib=False):>7} {_mib(r.get('heap'), kib=False):>7} "
                   f"{_mib(r.get('mmap'), kib=False):>6} {_mib(r.get('used'), kib=False):>7} "
                   f"{_mib(r.get('free'), kib=False):>7} {r['blocks']:9d}")
    if end is not None:
        out.append(f"at exit: hwm {_mib(end.get('hwm'), kib=True)} MiB, pool {end.get('pool')}, arrow max "
                   f"{_mib(end.get('arrow_max'), kib=False)} MiB; gc types: "
                   + ", ".join(f"{name} {n}" for name, n in end.get("gc_types", [])[:12]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path, nargs="+")
    args = parser.parse_args()
    for path in args.traces:
        print("\n".join(summarize(path)))
        print()


if __name__ == "__main__":
    main()
