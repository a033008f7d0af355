"""int8 (oneDNN / torchao) against bf16 on ONE thread, alternating: for a machine shared with others.

On a busy 2-core machine the wall tok/s of one configuration moved 150-400 between rounds of
benchmarks/quant/quantization.py; one OpenMP thread and the CPU time this process spent (time.process_time)
take most of that out. Two parts, each alternating the systems round by round:
1. layers: SmolLM2's linear shapes at T rows, nn.Linear in bf16 against the whole
   Int8DynamicLinear call (activation quantizer + oneDNN matmul + per-token scale); min of --reps;
2. end to end: the ShareGPT workload (ignore-EOS, greedy) through LLMEngine, tokens per CPU-second.

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.quant.int8_one_thread --n 64 --max-output-len 128 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import load_model
from batchgen.engine.request import Request, SamplingParams
from benchmarks import sharegpt
from benchmarks.peers.throughput import kv_blocks_for

# int8/onednn: the default recipe (quantize_recipe.INT8_RECIPE: outlier channels from a calibration
# pass, down_proj asymmetric, q/k/v and gate/up stacked); the variants below are quantized here from
# a bf16 load with the recipe's constants set for them:
#   int8/onednn+copies      the default with gate/up copied out of the stacked output (before views)
# The smoothed, unstacked, bf16-down_proj and int8-LM-head variants measured in benchmarks/README.md
# are not offered: no flag sets them.
SYSTEMS = {"bf16": ("none", "auto"), "int8/onednn": ("int8", "onednn"), "int8/torchao": ("int8", "torchao")}
VARIANTS = {"int8/onednn+copies": {"VIEW_SIBLINGS": ()}}


def load_variant(name: str, switches: dict | None = None):
    """A bf16 load quantized with `name`'s recipe switches (VARIANTS, or `switches`), restored
    afterwards. A switch is a module constant of engine/quant/int8_model.py (where the recipe's
    INT8_OUTLIER_FRACTION and INT8_ASYMMETRIC_LAYERS are read) or of engine/quant/int8_siblings.py
    (VIEW_SIBLINGS); "calibrate": False skips the calibration pass (no outlier channels)."""
    from batchgen.engine.quant import int8_model as quantize_int8_model
    from batchgen.engine.quant import int8_siblings as quantize_int8_siblings
    from batchgen.engine.quant import quantize
    from batchgen.engine.quant.calibration import calibration_ids

    switches = dict(VARIANTS[name] if switches is None else switches)
    calibrate = switches.pop("calibrate", True)
    lm = load_model(None, device="cpu", dtype="bfloat16")
    homes = {k: quantize_int8_model if hasattr(quantize_int8_model, k) else quantize_int8_siblings for k in switches}
    for k, home in homes.items():
        if not hasattr(home, k):
            raise SystemExit(f"unknown recipe switch {k!r}")
    saved = {k: getattr(homes[k], k) for k in switches}
    try:
        for k, v in switches.items():
            setattr(homes[k], k, tuple(v) if isinstance(v, list) else v)
        label = quantize.quantize_model(lm.model, "int8", "onednn", "none",
                                        calibration_ids(lm.tokenizer) if calibrate else None).label
    finally:
        for k, v in saved.items():
            setattr(homes[k], k, v)
    print(f"{name}: {label} {switches}", flush=True)
    return lm


def add_variants(spec: str) -> list[str]:
    """VARIANTS += the JSON object `spec` ({"name": {"SWITCH": value}}); returns the names."""
    extra = json.loads(spec) if spec else {}
    VARIANTS.update(extra)
    return list(extra)


SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 192)]  # q/o, gate/up, down, k/v of SmolLM2-135M


def best_ms(module, x: torch.Tensor, reps: int) -> float:
    module(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        module(x)
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


@torch.inference_mode()
def layers(rows: list[int], reps: int, outlier_fraction: float = 0.0, asymmetric: bool = False) -> None:
    from batchgen.engine.quant.int8 import Int8DynamicLinear

    torch.manual_seed(0)
    for in_f, out_f in SHAPES:
        linear = torch.nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        int8 = Int8DynamicLinear(linear)
        k = math.ceil(outlier_fraction * in_f)
        split = Int8DynamicLinear(linear, outliers=torch.arange(k) * (in_f // k)) if k else None
        asym = Int8DynamicLinear(linear, asymmetric=True) if asymmetric else None
        for t in rows:
            x = torch.randn(t, in_f, dtype=torch.bfloat16)
            bf16_ms, int8_ms = best_ms(linear, x, reps), best_ms(int8, x, reps)
            extra = ""
            if split is not None:
                split_ms = best_ms(split, x, reps)
                extra = f"  +{k} outlier channels {split_ms:.3f} ms {bf16_ms / split_ms:.2f}x"
            if asym is not None:
                asym_ms = best_ms(asym, x, reps)
                extra += f"  asymmetric {asym_ms:.3f} ms {bf16_ms / asym_ms:.2f}x"
            print(f"layer {in_f}x{out_f} T={t}: bf16 {bf16_ms:.3f} ms  int8/onednn {int8_ms:.3f} ms  "
                  f"{bf16_ms / int8_ms:.2f}x{extra}", flush=True)


def end_to_end(args) -> None:
    systems = args.systems.split(",")
    lms = {k: load_variant(k) if k in VARIANTS else load_model(None, device="cpu", dtype="bfloat16",
                                                               quantize=SYSTEMS[k][0], quantize_backend=SYSTEMS[k][1])
           for k in systems}
    workload = sharegpt.build_workload(lms[systems[0]].tokenizer, args.n, seed=0, max_prompt_len=args.max_prompt_len,
                                       max_output_len=args.max_output_len)
    blocks = kv_blocks_for(workload, args.max_num_seqs, 16)
    per_cpu_s: dict[str, list[float]] = {k: [] for k in systems}
    for rnd in range(args.rounds):
        for k in systems if rnd % 2 == 0 else systems[::-1]:
            engine = LLMEngine(lms[k].model, lms[k].tokenizer, EngineConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, block_size=16, num_kv_blocks=blocks))
            reqs = [Request(str(i), list(p), SamplingParams(max_new_tokens=o, ignore_eos=True))
                    for i, (p, o) in enumerate(workload)]
            cpu0, wall0 = time.process_time(), time.perf_counter()
            n = sum(len(c.token_ids) for c in engine.generate(reqs))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            per_cpu_s[k].append(n / cpu)
            print(f"round {rnd} {k:14s} {n} tokens  {n / cpu:7.1f} tok/cpu-s  {n / wall:7.1f} tok/s wall  "
                  f"threads {torch.get_num_threads()}", flush=True)
    base = statistics.median(per_cpu_s[systems[0]])
    for k, values in per_cpu_s.items():
        med = statistics.median(values)
        print(f"{k:14s} median {med:7.1f} tok/cpu-s  {med / base:.2f}x {systems[0]}  "
              f"rounds {[round(v, 1) for v in values]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--systems", default="bf16,int8/onednn",
                    help=f"first is the base; of {', '.join([*SYSTEMS, *VARIANTS])}")
    ap.add_argument("--variants", default="", help='more recipe variants, JSON: {"name": {"SWITCH": value}}')
    ap.add_argument("--layer-rows", default="128,2048", help="T of the layer part; empty: skip it")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--outlier-fraction", type=float, default=0.0,
                    help="layer part: also the int8 layer with this share of input channels as outliers")
    ap.add_argument("--asymmetric", action="store_true", help="layer part: also the asymmetric-activation int8 layer")
    args = ap.parse_args(argv)
    add_variants(args.variants)
    warnings.filterwarnings("ignore")
    if torch.get_num_threads() != 1:
        print(f"note: {torch.get_num_threads()} threads (set OMP_NUM_THREADS=1 for the one-thread comparison)")
    if args.layer_rows:
        layers([int(t) for t in args.layer_rows.split(",")], args.reps, args.outlier_fraction, args.asymmetric)
    end_to_end(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
