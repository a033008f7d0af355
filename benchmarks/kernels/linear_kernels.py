"""Linear-layer kernels at the embedded model's shapes: `F.linear` against oneDNN on a weight
reordered once (what engine/model/prepack.py installs), per dtype, thread count and row count.

    python -m benchmarks.kernels.linear_kernels --dtype float32,bfloat16 --threads 1,2

GFLOP/s = 2 * rows * N * K / seconds, the median of --iters calls after warm-up. The max abs
difference between the two results is printed beside, since the two kernels sum in other orders.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: gate/up (N=1536, K=576), down (576, 1536), q/o (576, 576), LM head (49152, 576)
SHAPES = ((1536, 576), (576, 1536), (576, 576), (49152, 576))
ROWS = (16, 64, 256, 512, 2048)


def median_seconds(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print("| dtype | threads | N x K | rows | F.linear GFLOP/s | oneDNN reordered GFLOP/s | ratio | max abs diff |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for n, k in SHAPES:
                weight = torch.randn(n, k, dtype=dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
                for rows in rows_list:
                    if n * rows > 49152 * 512:  # the LM head sees one row per sequence
                        continue
                    x = torch.randn(rows, k, dtype=dtype)
                    plain = median_seconds(lambda: F.linear(x, weight), args.iters)  # noqa: B023
                    onednn = median_seconds(
                        lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),  # noqa: B023
                        args.iters)
                    diff = (F.linear(x, weight).float()
                            - torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()).abs().max()
                    flop = 2 * rows * n * k
                    print(f"| {dtype_name} | {threads} | {n} x {k} | {rows} | {flop / plain / 1e9:.0f} | "
                          f"{flop / onednn / 1e9:.0f} | {plain / onednn:.2f}x | {diff.item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
