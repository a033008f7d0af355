"""Prefill attention on int8 KV pages: the C prefill kernel against the SDPA fallback it replaced.

One layer's prefill attention for --prompts sequences of --tokens new tokens each after --past
cached tokens (SmolLM2-135M's shape by default: 9 query heads over 3 KV heads of 64), timed as
the CPU backend runs it, with the step's K/V already in the pages:
  bf16/kernel   bf16 pages, csrc/prefill_attention.c
  int8/kernel   int8 pages + bf16 scales, the same kernel dequantizing as it packs
  int8/sdpa     int8 pages through backends/sdpa.py's prefill_forward (the path before the int8
                kernel: per sequence a gather + dequantize of its context when it has a cached
                past, then torch's causal SDPA)
  bf16/sdpa     bf16 pages through the same SDPA path, for scale
Variants alternate in rotated order each round; medians over rounds, and the CPU time other
processes took meanwhile (sysload.py: other_cores near 0 = a quiet machine).

    python -m benchmarks.kernels.prefill_int8                         # 8 prompts x 512 tokens, no past
    python -m benchmarks.kernels.prefill_int8 --past 512 --tokens 256  # chunks after a cached past
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from batchgen.engine.attention.base import LayerKV, PackedSeq
from batchgen.engine.attention.sdpa import build_prefills, prefill_forward
from batchgen.engine.kernels import prefill_attention
from batchgen.engine.kv import quant as kv_quant
from benchmarks import sysload

VARIANTS = ("bf16/kernel", "int8/kernel", "int8/sdpa", "bf16/sdpa")


def make_case(args: argparse.Namespace) -> dict:
    """Pages holding every context token (both dtypes), the step's q and new K/V, and its metadata."""
    ctx, bs = args.past + args.tokens, args.block_size
    blocks_per_seq = -(-ctx // bs)
    num_slots = (args.prompts * blocks_per_seq + 1) * bs
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(num_slots, args.kv_heads, args.head_dim, generator=gen)
    v = torch.randn(num_slots, args.kv_heads, args.head_dim, generator=gen)
    order = (torch.randperm(args.prompts * blocks_per_seq, generator=gen) + 1).tolist()  # scattered blocks
    seqs = [PackedSeq(i * args.tokens, args.tokens, args.past, order[i * blocks_per_seq:(i + 1) * blocks_per_seq])
            for i in range(args.prompts)]
    slots = torch.tensor([s.block_table[t // bs] * bs + t % bs for s in seqs for t in range(s.num_past_tokens, ctx)])
    kq, ks = kv_quant.quantize(k)
    vq, vs = kv_quant.quantize(v)
    q = torch.randn(args.prompts * args.tokens, args.heads, args.head_dim, generator=gen).to(torch.bfloat16)
    return dict(
        q=q, seqs=seqs,
        bf16=(LayerKV(k.bfloat16(), v.bfloat16(), bs), k[slots].bfloat16(), v[slots].bfloat16()),
        int8=(LayerKV(kq, vq, bs, ks, vs), kv_quant.dequantize(kq[slots], ks[slots], torch.bfloat16),
              kv_quant.dequantize(vq[slots], vs[slots], torch.bfloat16)),
    )


def run_ms(variant: str, case: dict, args: argparse.Namespace) -> float:
    pages, path = variant.split("/")
    layer, k_new, v_new = case[pages]
    q, seqs, scale = case["q"], case["seqs"], args.head_dim ** -0.5
    out = torch.empty_like(q)
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        if path == "kernel":  # metadata built inside the timing, as once per step in the backend
            batch = prefill_attention.PrefillBatch.build(seqs, layer.block_size)
            scales = None if layer.k_scale is None else (layer.k_scale, layer.v_scale)
            prefill_attention.load()(q, out, layer.k_cache, layer.v_cache, batch, layer.block_size, scale, scales)
        else:
            prefill_forward(q, k_new, v_new, layer, build_prefills(seqs, layer.block_size, q.device), scale, out)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="new tokens per sequence")
    ap.add_argument("--past", type=int, default=0, help="cached tokens before them")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="calls per variant per round (median)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = prefill_attention.load()
    if kernel is None or not kernel.supports(torch.bfloat16, torch.int8, args.head_dim):
        raise SystemExit("no C prefill kernel for bf16 queries over int8 pages on this CPU (AVX512-BF16)")
    case = make_case(args)
    for variant in VARIANTS:  # warm-up: first-call allocations and the kernel's build
        run_ms(variant, case, args)
    ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with sysload.measure() as load:
        for rnd in range(args.rounds):
            for variant in VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]:
                ms[variant].append(run_ms(variant, case, args))
    med = {v: round(statistics.median(x), 3) for v, x in ms.items()}
    rounds_ms = {v: [round(t, 3) for t in x] for v, x in ms.items()}
    record = dict(args=vars(args), median_ms=med, rounds_ms=rounds_ms, load=load.to_dict(),
                  int8_kernel_vs_sdpa=round(med["int8/sdpa"] / med["int8/kernel"], 2),
                  int8_vs_bf16_kernel=round(med["int8/kernel"] / med["bf16/kernel"], 3))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
