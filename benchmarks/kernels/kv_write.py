"""What the int8 KV cache's write costs per layer and step: microseconds per call.

    OMP_NUM_THREADS=1 python -m benchmarks.kernels.kv_write                      # 128 decode rows, SmolLM2-135M's KV
    python -m benchmarks.kernels.kv_write --rows 512 --kv-heads 8 --head-dim 128 --dtype float32

Three writes of the same step's new K/V ([rows, kv_heads, head_dim], laid out as the attention op
gets them) into int8 pages at random slots:
- "torch+dequant": the write in torch ops that also dequantizes: kv_quant's torch ops (quantize K and V, four
  index_copy_) and then both dequantized for the return value;
- "torch": kv_quant.write_torch (the fallback without the C library, and CUDA's path);
- "c": kv_quant.write on CPU, one call into csrc/kv_quant_write.c.
The three run round-robin, --calls calls each per round, for --rounds rounds; each figure is the
median over rounds of a round's mean per call. The CPU the other processes took meanwhile
(benchmarks/sysload.py) comes with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from batchgen.engine.kernels import kv_quant_write
from batchgen.engine.kv import quant as kv_quant
from benchmarks.sysload import measure


def _old_write_exact(k_cache, v_cache, k_scale, v_scale, slots, k, v):
    """kv_quant.write in torch ops that also dequantize for the return value, op for op."""
    kq, ks = kv_quant.quantize(k)
    vq, vs = kv_quant.quantize(v)
    k_cache.index_copy_(0, slots, kq)
    v_cache.index_copy_(0, slots, vq)
    k_scale.index_copy_(0, slots, ks)
    v_scale.index_copy_(0, slots, vs)
    return kv_quant.dequantize(kq, ks, k.dtype), kv_quant.dequantize(vq, vs, v.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-slots", type=int, default=65536)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    assert kv_quant_write.load() is not None, "the C write did not build"
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    # token-major memory seen as [1, kv_heads, rows, head_dim] then transposed back, as the op gets k/v
    k, v = (torch.randn(1, args.rows, args.kv_heads, args.head_dim, generator=gen).to(dtype).transpose(1, 2)[0]
            .transpose(0, 1) for _ in range(2))
    slots = torch.randperm(args.num_slots, generator=gen)[:args.rows]
    pages = [torch.zeros(args.num_slots, args.kv_heads, args.head_dim, dtype=torch.int8) for _ in range(2)]
    pages += [torch.zeros(args.num_slots, args.kv_heads, dtype=kv_quant.SCALE_DTYPE) for _ in range(2)]
    writes = {"torch+dequant": _old_write_exact, "torch": kv_quant.write_torch, "c": kv_quant.write}
    per_call_us: dict[str, list[float]] = {name: [] for name in writes}
    with measure() as load:
        for _ in range(args.rounds + 1):  # the first round warms up, unrecorded
            for name, fn in writes.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn(*pages, slots, k, v)
                per_call_us[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    med = {name: round(statistics.median(times[1:]), 2) for name, times in per_call_us.items()}
    print(json.dumps({"rows": args.rows, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype,
                      "threads": torch.get_num_threads(), "median_us_per_call": med,
                      "speedup_vs_old": round(med["torch+dequant"] / med["c"], 1),
                      "wall_s": round(load.wall_s, 1), "other_cores": load.other_cores}))


if __name__ == "__main__":
    main()
