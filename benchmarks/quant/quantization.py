"""Speed and memory of the quantization schemes, side by side, round-robin in one process.

Every variant is the embedded model in bf16 on the CPU, quantized after loading:
  weights   none | int8/torchao | int8/onednn | int8-weight/torchao | int8-weight/quanto | int4/torchao | int4/quanto
  KV cache  bf16 | int8

Measured, each round visiting every system in a rotated order (medians over rounds; the CPU time
other processes took during each run is recorded, see sysload.py):
1. end-to-end generated tokens/s on the ShareGPT workload (ignore-EOS, greedy) through LLMEngine,
   continuous policy, a KV cache large enough not to preempt;
2. linear-layer time per step: every decoder linear of the model on T rows of activations
   (T = --max-num-seqs, a decode step; and T = --max-num-batched-tokens, a full prefill step);
3. weight bytes (the tensors' storage, quantized inner tensors counted once);
4. KV: tokens one --pressure-kv budget holds in bf16 and int8; the C kernel's decode attention
   time per step (all layers, each its own cache) at --max-num-seqs sequences of the workload's
   mean context; and tokens/s
   of bf16 weights with bf16 vs int8 KV under that budget (which preempts at bf16).

    python -m benchmarks.quant.quantization --quick          # 32 requests, outputs <= 64, 1 round
    python -m benchmarks.quant.quantization                  # 256 requests, prompts/outputs <= 512, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.kernels import paged_decode
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.kv.cache import KVCacheSpec
from batchgen.engine.model.loader import load_model
from batchgen.engine.quant.quantize import weight_bytes
from batchgen.engine.request import Request, SamplingParams
from benchmarks import sharegpt, sysload
from benchmarks.common import write_record
from benchmarks.peers.throughput import kv_blocks_for

WEIGHTS = [("bf16", "none", "auto"), ("int8/torchao", "int8", "torchao"), ("int8/onednn", "int8", "onednn"),
           ("int8-weight/torchao", "int8-weight", "torchao"), ("int8-weight/quanto", "int8-weight", "quanto"),
           ("int4/torchao", "int4", "torchao"), ("int4/quanto", "int4", "quanto")]


def run_engine(lm, workload, args, *, kv_cache_dtype="auto", num_kv_blocks=None, kv_cache_bytes=None) -> dict:
    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=16,
        num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes, kv_cache_dtype=kv_cache_dtype))
    reqs = [Request(str(i), list(p), SamplingParams(max_new_tokens=o, ignore_eos=True))
            for i, (p, o) in enumerate(workload)]
    with sysload.measure() as load:
        n = sum(len(c.token_ids) for c in engine.generate(reqs))
    s = engine.metrics.summary()
    out = {"tok_s": n / load.wall_s, "wall_s": load.wall_s, "other_cores": load.other_cores,
           # tokens per CPU-second this process spent: on a shared machine a steadier comparison than
           # tok/s (a run that lost a core to others loses wall time, much less CPU time)
           "own_cpu_s": load.own_cpu_s, "tok_per_cpu_s": n / load.own_cpu_s if load.own_cpu_s else None,
           "num_steps": s.get("num_steps"), "num_preemptions": s.get("num_preemptions"),
           "kv_tokens": engine.kv_cache.num_blocks * engine.block_size}
    lm.model.set_attn_implementation("sdpa")
    return out


@torch.inference_mode()
def linear_ms(model, num_rows: int, reps: int = 2) -> float:
    """Milliseconds for every decoder linear of `model` on num_rows rows (one step's worth)."""
    layers = model.model.layers
    hidden = torch.randn(num_rows, model.config.hidden_size, dtype=torch.bfloat16)
    inter = torch.randn(num_rows, model.config.intermediate_size, dtype=torch.bfloat16)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for layer in layers:
            a = layer.self_attn
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
                lin(hidden if lin is not a.o_proj else hidden[:, : a.o_proj.in_features])
            layer.mlp.down_proj(inter)
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def attention_ms(spec_bf16: KVCacheSpec, num_seqs: int, ctx: int, cache_dtype: torch.dtype,
                 num_layers: int, reps: int = 5) -> float:
    """The C kernel's decode attention for one whole step: num_seqs sequences of ctx tokens in each
    of num_layers layers, every layer reading its own cache. A run's cache is far larger than the
    CPU's caches, so each layer-step reads its K/V from memory; timing one layer's cache over and
    over would keep it in L2/L3 and hide what the smaller int8 rows save."""
    kernel = paged_decode.load()
    bs, kvh, d = spec_bf16.block_size, spec_bf16.num_kv_heads, spec_bf16.head_dim
    heads = 9  # SmolLM2-135M: 9 query heads over 3 KV heads
    blocks_per_seq = -(-ctx // bs)
    num_slots = (num_seqs * blocks_per_seq + 1) * bs
    perm = torch.randperm(num_seqs * blocks_per_seq).add_(1).to(torch.int32).view(num_seqs, blocks_per_seq)
    q = torch.randn(num_seqs, heads, d, dtype=torch.bfloat16)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
    layers = []
    for _ in range(num_layers):
        x = torch.randn(num_slots, kvh, d)
        if cache_dtype == torch.int8:
            kc, ks = kv_quant.quantize(x)
            vc, vs = kv_quant.quantize(x.flip(0).contiguous())
            layers.append((kc, vc, (ks, vs)))
        else:
            layers.append((x.to(cache_dtype), x.flip(0).contiguous().to(cache_dtype), None))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for kc, vc, scales in layers:
            kernel(q, kc, vc, perm, lens, bs, d ** -0.5, scales)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--pressure-kv", default="256MiB", help="KV budget of the preemption comparison")
    ap.add_argument("--weights", default=",".join(w[0] for w in WEIGHTS))
    ap.add_argument("--skip-e2e", action="store_true", help="only the micro measurements and KV capacity")
    ap.add_argument("--skip-kv-pressure", action="store_true",
                    help="no bf16-vs-int8 KV runs under --pressure-kv (the weights' runs only)")
    ap.add_argument("--kv-int8-runs", action="store_true",
                    help="also bf16 and int8/onednn weights with the int8 KV cache, no preemption (w:...+kv:int8)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.max_output_len, args.repeats = 32, 64, 1
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    from batchgen.config.job import parse_bytes

    variants = {}
    for label, scheme, backend in WEIGHTS:
        if label in args.weights.split(","):
            variants[label] = load_model(None, device="cpu", dtype="bfloat16", quantize=scheme,
                                         quantize_backend=backend)
    base = variants["bf16"]
    workload = sharegpt.build_workload(base.tokenizer, args.n, seed=0, max_prompt_len=args.max_prompt_len,
                                       max_output_len=args.max_output_len)
    kv_blocks = kv_blocks_for(workload, args.max_num_seqs, 16)
    budget = parse_bytes(args.pressure_kv)
    spec = KVCacheSpec.from_model_config(base.model.config, torch.bfloat16, 16)
    spec8 = KVCacheSpec.from_model_config(base.model.config, torch.int8, 16)
    mean_ctx = int(statistics.mean(len(p) + o / 2 for p, o in workload))
    record: dict = {"args": vars(args), "workload": sharegpt.describe(workload),
                    "weight_bytes": {k: weight_bytes(v.model) for k, v in variants.items()},
                    "kv": {"budget_bytes": budget, "bf16_bytes_per_token": spec.bytes_per_token,
                           "int8_bytes_per_token": spec8.bytes_per_token,
                           "bf16_tokens": budget // spec.bytes_per_block * 16,
                           "int8_tokens": budget // spec8.bytes_per_block * 16, "mean_context": mean_ctx},
                    "rounds": []}
    systems = [(f"w:{k}", k) for k in variants]
    if not args.skip_kv_pressure:
        systems += [("kv:bf16@budget", "auto"), ("kv:int8@budget", "int8")]
    if args.kv_int8_runs:  # the int8 KV cache without preemption: on bf16 weights, and with --quantize int8
        systems += [(f"w:{k}+kv:int8", k) for k in variants if k in ("bf16", "int8/onednn")]
    if args.skip_e2e:
        systems = []
    for rnd in range(args.repeats):
        r: dict = {"linear_ms": {}, "attention_ms": {}, "e2e": {}}
        for label, v in variants.items():  # micro: interleaved every round
            r["linear_ms"][label] = {str(t): linear_ms(v.model, t) for t in (args.max_num_seqs,
                                                                              args.max_num_batched_tokens)}
        for name, dt in (("bf16", torch.bfloat16), ("int8", torch.int8), ("bf16 ", torch.bfloat16)):
            r["attention_ms"].setdefault(name.strip(), []).append(
                attention_ms(spec, args.max_num_seqs, mean_ctx, dt, base.model.config.num_hidden_layers))
        print(f"round {rnd} linear ms per step {json.dumps(r['linear_ms'])}  decode attention ms per step "
              f"{json.dumps(r['attention_ms'])}", flush=True)
        order = systems[rnd % len(systems):] + systems[: rnd % len(systems)] if systems else []
        for name, arg in order:
            if name.endswith("+kv:int8"):
                r["e2e"][name] = run_engine(variants[arg], workload, args, kv_cache_dtype="int8",
                                            num_kv_blocks=kv_blocks)
            elif name.startswith("w:"):
                r["e2e"][name] = run_engine(variants[arg], workload, args, num_kv_blocks=kv_blocks)
            else:
                r["e2e"][name] = run_engine(base, workload, args, kv_cache_dtype=arg, kv_cache_bytes=budget)
            print(f"round {rnd} {name:24s} {r['e2e'][name]['tok_s']:7.1f} tok/s  "
                  f"{r['e2e'][name]['tok_per_cpu_s'] or 0:7.1f} tok/cpu-s  "
                  f"preemptions {r['e2e'][name]['num_preemptions']}  other cores {r['e2e'][name]['other_cores']}",
                  flush=True)
        record["rounds"].append(r)

    def med(values):
        return statistics.median(values)

    summary = {"weights": {}, "kv": dict(record["kv"])}
    for label in variants:
        s = {"weight_bytes": record["weight_bytes"][label],
             "weight_ratio_vs_bf16": record["weight_bytes"][label] / record["weight_bytes"]["bf16"]}
        for t in (args.max_num_seqs, args.max_num_batched_tokens):
            s[f"linear_ms_T{t}"] = med([r["linear_ms"][label][str(t)] for r in record["rounds"]])
        if systems:
            s["tok_s"] = med([r["e2e"][f"w:{label}"]["tok_s"] for r in record["rounds"]])
            s["tok_per_cpu_s"] = med([r["e2e"][f"w:{label}"]["tok_per_cpu_s"] or 0 for r in record["rounds"]])
        summary["weights"][label] = s
    for s in summary["weights"].values():
        b = summary["weights"]["bf16"]
        s["linear_speedup_T_decode"] = b[f"linear_ms_T{args.max_num_seqs}"] / s[f"linear_ms_T{args.max_num_seqs}"]
        if systems:
            s["tok_s_vs_bf16"] = s["tok_s"] / b["tok_s"]
            s["tok_per_cpu_s_vs_bf16"] = s["tok_per_cpu_s"] / b["tok_per_cpu_s"] if b["tok_per_cpu_s"] else None
    kv = summary["kv"]
    kv["capacity_ratio"] = kv["int8_tokens"] / kv["bf16_tokens"]
    kv["attention_ms_bf16"] = med([x for r in record["rounds"] for x in r["attention_ms"]["bf16"]])
    kv["attention_ms_int8"] = med([x for r in record["rounds"] for x in r["attention_ms"]["int8"]])
    kv["attention_ratio_int8_vs_bf16"] = kv["attention_ms_int8"] / kv["attention_ms_bf16"]
    if systems and not args.skip_kv_pressure:
        for name in ("kv:bf16@budget", "kv:int8@budget"):
            kv[name] = {"tok_s": med([r["e2e"][name]["tok_s"] for r in record["rounds"]]),
                        "num_preemptions": [r["e2e"][name]["num_preemptions"] for r in record["rounds"]]}
        kv["pressure_speedup"] = kv["kv:int8@budget"]["tok_s"] / kv["kv:bf16@budget"]["tok_s"]
    for name in [n for n, _ in systems if n.endswith("+kv:int8")]:
        weights = name[2:-len("+kv:int8")]
        kv[name] = {"tok_s": med([r["e2e"][name]["tok_s"] for r in record["rounds"]]),
                    "tok_per_cpu_s": med([r["e2e"][name]["tok_per_cpu_s"] or 0 for r in record["rounds"]])}
        kv[name]["tok_s_vs_bf16"] = kv[name]["tok_s"] / summary["weights"]["bf16"]["tok_s"]
        kv[name]["tok_s_vs_same_weights_bf16_kv"] = kv[name]["tok_s"] / summary["weights"][weights]["tok_s"]
    record["summary"] = summary
    print(json.dumps(summary, indent=1))
    record["benchmark"] = "quantization"
    write_record(record, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
