"""oneDNN's kernel caches against a cap: the heap a pass over every row count leaves, and what a
second pass over the same calls costs (kernels rebuilt when the cap evicted them).

    OMP_NUM_THREADS=1 python -m benchmarks.kernels.kernel_cache --caps none,64,256 --dtype float32,bfloat16

The linear layers of a model's distinct shapes (--shapes tiny: tests/tiny.py's Llama, 5 shapes;
smollm: SmolLM2-135M's 4 layer shapes, LM head left out), on weights reordered once as the engine
runs them (engine/model/prepack.py), are called at every row count 1..--max-rows, twice. Each cap runs
in a fresh process, since oneDNN and ideep read their capacity once:

    none          both caches at the library default (1024 each)
    N             ONEDNN_PRIMITIVE_CACHE_CAPACITY=N and LRU_CACHE_CAPACITY=N (batchgen/runtime/onednn_cache.py)
    onednn=N      oneDNN's primitive cache only; ideep=N: ideep's descriptor cache only

Printed per cap: glibc heap in use (mallinfo2) and VmRSS after one warm call per layer ("base")
and after the first pass; both passes' seconds; after the second pass, the free bytes glibc keeps
(evicted kernels' memory) and VmRSS, then VmRSS after batchgen.runtime.heap.trim_heap (malloc_trim) and
how long that took. A pass over calls all cached costs only the
matmuls; the first pass's extra over that is kernel building (/ calls: the cost of a miss).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPES = {  # (in_features, out_features) of each distinct linear shape
    "tiny": ((64, 64), (64, 32), (64, 128), (128, 64), (64, 261)),
    "smollm": ((576, 576), (576, 192), (576, 1536), (1536, 576)),
}
VARIABLES = {"onednn": "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "ideep": "LRU_CACHE_CAPACITY"}

CHILD = """
import json, sys, time
import torch
from batchgen.engine.model.prepack import pack_linear_layers
from batchgen.runtime.heap import trim_heap
from benchmarks.scale.rss_trace import _mallinfo2, _status

shapes, dtype, max_rows = json.loads(sys.argv[1]), getattr(torch, sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(k, n, bias=False) for k, n in shapes]).to(dtype)
assert pack_linear_layers(model, available_bytes=1 << 40) == len(shapes), "oneDNN path not taken"
inputs = [torch.randn(max_rows, k, dtype=dtype) for k, _ in shapes]
mallinfo = _mallinfo2()

def memory():
    m = mallinfo()
    return {"heap_used_mib": round((m.uordblks + m.hblkhd) / 2**20, 1), "heap_free_mib": round(m.fordblks / 2**20, 1),
            "rss_mib": round(_status()["rss"] / 1024, 1)}

def one_pass():
    t0 = time.perf_counter()
    with torch.no_grad():
        for rows in range(1, max_rows + 1):
            for layer, x in zip(model, inputs):
                layer(x[:rows])
    return round(time.perf_counter() - t0, 3)

with torch.no_grad():
    for layer, x in zip(model, inputs):
        layer(x[:1])
base = memory()
first = one_pass()
after = memory()
second = one_pass()
after_second = memory()
t0 = time.perf_counter()
trimmed = trim_heap()
trim_s = round(time.perf_counter() - t0, 4)
print(json.dumps({"base": base, "after_first_pass": after, "first_pass_s": first, "second_pass_s": second,
                  "after_second_pass": after_second, "after_trim": memory(), "trim_s": trim_s, "trimmed": trimmed,
                  "calls_per_pass": max_rows * len(shapes)}))
"""


def cap_env(spec: str) -> dict[str, str]:
    """'none' -> {}, '64' -> both caches, 'onednn=64' / 'ideep=64' -> one."""
    if spec == "none":
        return {}
    if "=" in spec:
        which, value = spec.split("=", 1)
        return {VARIABLES[which]: value}
    return {name: spec for name in VARIABLES.values()}


def run_cap(spec: str, shapes, dtype: str, max_rows: int) -> dict:
    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    env.update(cap_env(spec), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shapes), dtype, str(max_rows)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", default="none,64,256")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--max-rows", type=int, default=512)
    args = ap.parse_args()
    print("| dtype | cap | heap in use, base -> after pass 1 (MiB) | RSS (MiB) | pass 1 s | pass 2 s "
          "| after pass 2: heap free, RSS (MiB) | after malloc_trim: RSS (MiB), s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for dtype in args.dtype.split(","):
        for spec in args.caps.split(","):
            r = run_cap(spec, SHAPES[args.shapes], dtype, args.max_rows)
            b, a, a2 = r["base"], r["after_first_pass"], r["after_second_pass"]
            print(f"| {dtype} | {spec} | {b['heap_used_mib']} -> {a['heap_used_mib']} | {b['rss_mib']} -> "
                  f"{a['rss_mib']} | {r['first_pass_s']} | {r['second_pass_s']} | {a2['heap_free_mib']}, "
                  f"{a2['rss_mib']} | {r['after_trim']['rss_mib']}, {r['trim_s']} |", flush=True)
            print(json.dumps({"dtype": dtype, "cap": spec, "shapes": args.shapes, **r}), file=sys.stderr)


if __name__ == "__main__":
    main()
