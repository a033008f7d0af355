"""Offline generation throughput on a ShareGPT-length workload: batchgen against transformers.

    python -m benchmarks.peers.throughput --quick                      # 32 requests, outputs <= 64, 1 round
    python -m benchmarks.peers.throughput --dtype float32,bfloat16     # 256 requests, caps 512, 3 rounds

Systems, greedy unless named sampled, all with ignore-EOS so each generates exactly the requested
output lengths:
  batchgen-continuous  LLMEngine, Policy.CONTINUOUS (--max-num-seqs, --max-num-batched-tokens)
  batchgen-sampled     the same engine, temperature 0.8, top-p 0.95, no per-row seed (derived from the id)
  batchgen-sampled-seeded  the same with a seed per row
  batchgen-static      LLMEngine, Policy.STATIC, batches of --max-num-seqs
  hf-generate          model.generate on left-padded batches of --hf-batch-size in dataset order,
                       max_new_tokens = the batch's longest output, eos_token_id=None; only each
                       row's requested length counts as useful tokens (padding work is not credited)
  hf-continuous        transformers' continuous batching manager (sdpa), per-request max_new_tokens

Tokens/s = requested output tokens / wall seconds of the generation call (engine construction and
cache allocation excluded). Systems run round-robin in one process (--repeats rounds, the start
rotating each round); each run records the CPU seconds other processes took meanwhile (sysload).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from batchgen.config.choices import Policy
from batchgen.engine.attention.registry import resolve_backend
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import LoadedModel, load_model
from batchgen.engine.request import Request, SamplingParams
from benchmarks import sharegpt, sysload
from benchmarks.common import args_config, environment, write_record

SYSTEMS = ("batchgen-continuous", "batchgen-static", "hf-generate", "hf-continuous", "batchgen-sampled",
           "batchgen-sampled-seeded")
SAMPLED = dict(temperature=0.8, top_p=0.95)  # the sampled systems' settings, common ones for synthetic data
BASELINES = ("hf-generate", "hf-continuous")
CHECK_PROMPTS, CHECK_TOKENS = 4, 16
HF_CB_RESULT_TIMEOUT_S = 600  # no result for this long: the manager is stuck

Workload = sharegpt.Workload


@dataclass(slots=True)
class RunResult:
    outputs: dict[int, list[int]]  # workload index -> generated token ids (hf-generate: the useful part)
    useful_tokens: int  # the requested output lengths, summed
    computed_tokens: int  # tokens actually generated, padding rows included
    load: sysload.LoadRecord
    extra: dict = field(default_factory=dict)


# ---- systems -------------------------------------------------------------------------------------
def kv_blocks_for(workload: Workload, max_num_seqs: int, block_size: int) -> int:
    """Blocks for the max_num_seqs longest requests at full length, plus slack: no preemption."""
    per_seq = sorted((math.ceil((len(p) + o) / block_size) for p, o in workload), reverse=True)
    need = sum(per_seq[:max_num_seqs])
    return need + max(4, need // 50)


def run_batchgen(lm: LoadedModel, workload: Workload, args, policy: Policy, kv_blocks: int,
                 sampling: dict | None = None, seeded: bool = False) -> RunResult:
    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(
        policy=policy, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_kv_blocks=kv_blocks, enable_prefix_caching=True,
        attention_backend=args.attention_backend, cuda_graphs=not args.no_cuda_graphs))
    requests = [Request(str(i), list(p), SamplingParams(max_new_tokens=o, ignore_eos=True, **(sampling or {}),
                                                        seed=1000 + i if seeded else None))
                for i, (p, o) in enumerate(workload)]
    with sysload.measure() as load:
        outputs = {int(c.request_id): c.token_ids for c in engine.generate(requests)}
    computed = sum(len(t) for t in outputs.values())
    summary = engine.metrics.summary()
    extra = {k: summary.get(k) for k in ("num_steps", "step_ms_mean", "step_ms_p50", "running_mean", "running_max",
                                         "num_preemptions", "kv_blocks_used_max", "kv_blocks_total")}
    extra["attention_backend"] = engine.backend.name
    extra["block_size"] = engine.block_size
    if engine.runner.graphs is not None:
        extra["cuda_graph_steps"] = engine.runner.graphs.stats.num_graph_steps
    if engine.device.type == "cuda":
        extra["device_timing"] = engine.runner.timing.summary()
    del engine
    return RunResult(outputs, sum(o for _, o in workload), computed, load, extra)


def hf_generate_batch(model, pad_id: int, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy, left-padded, EOS disabled: every row runs max_new_tokens steps."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p)
        attention_mask[row, width - len(p):] = 1
    # eos_token_id=None must be a keyword: inside a GenerationConfig, None is replaced by the model's default
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    return out[:, width:].tolist()  # [batch, max_new_tokens]


@torch.inference_mode()
def run_hf_generate(lm: LoadedModel, workload: Workload, args) -> RunResult:
    lm.model.set_attn_implementation("sdpa")
    pad_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    outputs: dict[int, list[int]] = {}
    computed = 0
    with sysload.measure() as load:
        for start in range(0, len(workload), args.hf_batch_size):
            batch = workload[start:start + args.hf_batch_size]
            max_new = max(o for _, o in batch)
            rows = hf_generate_batch(lm.model, pad_id, [p for p, _ in batch], max_new)
            computed += len(batch) * max_new
            for i, ((_, o), row) in enumerate(zip(batch, rows, strict=True)):
                outputs[start + i] = row[:o]
    return RunResult(outputs, sum(o for _, o in workload), computed, load,
                     {"batch_size": args.hf_batch_size, "padding_tokens": computed - sum(o for _, o in workload)})


class _DropPsutilNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


@torch.inference_mode()
def run_hf_continuous(lm: LoadedModel, workload: Workload, args, kv_blocks: int) -> RunResult:
    model = lm.model
    model.set_attn_implementation("sdpa")
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=lm.tokenizer.pad_token_id,
                                  max_new_tokens=max(o for _, o in workload))
    # explicit sizes: on CPU its defaults plan the cache from a share of system RAM (gigabytes);
    # page_size = our block size, so both paged systems get the same KV capacity in tokens
    cb_config = ContinuousBatchingConfig(
        page_size=args.block_size, num_blocks=kv_blocks, max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs, auto_switch_to_flash=False, allow_block_sharing=True)
    outputs: dict[int, list[int]] = {}
    errors: list[str] = []
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=60, warmup=True) as manager:
        resolved = manager.continuous_batching_config
        with sysload.measure() as load:
            for i, (p, o) in enumerate(workload):
                manager.add_request(list(p), request_id=str(i), max_new_tokens=o, eos_token_id=-1)
            waited = 0.0
            while len(outputs) + len(errors) < len(workload):
                result = manager.get_result(timeout=1)
                if result is None:
                    waited += 1
                    if not manager.is_running() or waited > HF_CB_RESULT_TIMEOUT_S:
                        errors.append(f"manager stopped with {len(workload) - len(outputs)} requests unfinished")
                        break
                    continue
                waited = 0.0
                if result.is_finished():
                    if result.error is not None:
                        errors.append(f"{result.request_id}: {result.error}")
                    outputs[int(result.request_id)] = list(result.generated_tokens)
    if errors:
        raise RuntimeError(f"hf-continuous failed: {errors[:3]}")
    computed = sum(len(t) for t in outputs.values())
    return RunResult(outputs, sum(o for _, o in workload), computed, load,
                     {"num_blocks": resolved.num_blocks, "max_batch_tokens": resolved.max_batch_tokens,
                      "max_requests_per_batch": resolved.max_requests_per_batch})


def system_runner(name: str, args, kv_blocks: int) -> Callable[[LoadedModel, Workload], RunResult]:
    if name == "batchgen-continuous":
        return lambda lm, w: run_batchgen(lm, w, args, Policy.CONTINUOUS, kv_blocks)
    if name == "batchgen-sampled":
        return lambda lm, w: run_batchgen(lm, w, args, Policy.CONTINUOUS, kv_blocks, SAMPLED)
    if name == "batchgen-sampled-seeded":
        return lambda lm, w: run_batchgen(lm, w, args, Policy.CONTINUOUS, kv_blocks, SAMPLED, seeded=True)
    if name == "batchgen-static":
        return lambda lm, w: run_batchgen(lm, w, args, Policy.STATIC, kv_blocks)
    if name == "hf-generate":
        return lambda lm, w: run_hf_generate(lm, w, args)
    if name == "hf-continuous":
        return lambda lm, w: run_hf_continuous(lm, w, args, kv_blocks)
    raise ValueError(name)


# ---- correctness gate ----------------------------------------------------------------------------
@torch.inference_mode()
def greedy_check(lm: LoadedModel, workload: Workload, systems: list[str], args, kv_blocks: int) -> dict:
    """First CHECK_TOKENS greedy tokens of each system vs unpadded HF generate; doubles as a warmup."""
    small = [(p, CHECK_TOKENS) for p, _ in workload[:CHECK_PROMPTS]]
    lm.model.set_attn_implementation("sdpa")
    pad_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    reference = [hf_generate_batch(lm.model, pad_id, [p], CHECK_TOKENS)[0] for p, _ in small]
    report = {}
    for name in systems:
        if name == "hf-generate" or name.startswith("batchgen-sampled"):  # sampled: no greedy reference
            continue
        result = system_runner(name, args, kv_blocks)(lm, small)
        mismatches = []
        for i, ref in enumerate(reference):
            got = result.outputs.get(i, [])[:CHECK_TOKENS]
            if got != ref:
                pairs = enumerate(zip(got, ref, strict=False))
                first = next((k for k, (a, b) in pairs if a != b), min(len(got), len(ref)))
                mismatches.append({"prompt": i, "first_diff_token": first})
        report[name] = {"ok": not mismatches, "mismatches": mismatches}
        if mismatches:
            print(f"WARNING: {name} ({lm.dtype}) greedy output differs from HF generate on "
                  f"{len(mismatches)}/{len(small)} prompts (first {CHECK_TOKENS} tokens): {mismatches}", flush=True)
    gc.collect()
    return report


# ---- the benchmark -------------------------------------------------------------------------------
def summarize(runs: list[dict], dtypes: list[str], systems: list[str]) -> dict:
    summary: dict = {}
    for dtype in dtypes:
        per: dict = {}
        for name in systems:
            rates = [r["tokens_per_s"] for r in runs if r["dtype"] == dtype and r["system"] == name]
            if rates:
                per[name] = {"runs": len(rates), "min": round(min(rates), 2),
                             "median": round(statistics.median(rates), 2), "max": round(max(rates), 2)}
        for name, stats in per.items():
            for base in BASELINES:
                if base in per and base != name:
                    stats[f"vs_{base}"] = round(stats["median"] / per[base]["median"], 3)
        summary[dtype] = per
    if "float32" in summary and "bfloat16" in summary:
        for name, stats in summary["bfloat16"].items():
            if name in summary["float32"]:
                stats["vs_float32"] = round(stats["median"] / summary["float32"][name]["median"], 3)
    return summary


def print_summary(summary: dict) -> None:
    print("\n{:<20} {:<9} {:>4} {:>9} {:>9} {:>9} {:>11} {:>13}".format(
        "system", "dtype", "runs", "min t/s", "med t/s", "max t/s", "vs hf-gen", "vs hf-cb"))
    for dtype, per in summary.items():
        for name, s in per.items():
            print("{:<20} {:<9} {:>4} {:>9.1f} {:>9.1f} {:>9.1f} {:>11} {:>13}".format(
                name, dtype, s["runs"], s["min"], s["median"], s["max"],
                f"{s['vs_hf-generate']:.2f}x" if "vs_hf-generate" in s else "-",
                f"{s['vs_hf-continuous']:.2f}x" if "vs_hf-continuous" in s else "-"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.throughput", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF id, directory or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", help="comma list of float32, bfloat16")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--n", type=int, default=256, help="number of requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="rounds; each system runs once per round")
    p.add_argument("--max-num-seqs", type=int, default=128, help="batchgen concurrency and static batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--block-size", type=int, default=None, help="KV block size [the attention backend's: 256 "
                   "flash-attn, else 16]; also transformers' continuous-batching page size")
    p.add_argument("--attention-backend", default="auto", help="batchgen's: auto, cpu (C kernels), sdpa, flash")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when present")
    p.add_argument("--no-cuda-graphs", action="store_true", help="batchgen: run decode steps eagerly on CUDA")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 is steadier on a busy machine)")
    p.add_argument("--quick", action="store_true", help="development preset: --n 32 --max-output-len 64 --repeats 1")
    p.add_argument("--skip-check", action="store_true", help="skip the greedy equality check")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.max_output_len, args.repeats = 32, 64, 1
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    for d in args.dtypes:
        if d not in ("float32", "bfloat16"):
            p.error(f"--dtype: {d!r} is not float32 or bfloat16")
    for s in args.system_list:
        if s not in SYSTEMS:
            p.error(f"--systems: unknown {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.n < 1 or args.repeats < 1:
        p.error("--n and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ContinuousBatchingLogger").addFilter(_DropPsutilNoise())
    t_start = time.perf_counter()
    models = {d: load_model(args.model, device=args.device, dtype=d) for d in args.dtypes}
    first = models[args.dtypes[0]]
    if args.block_size is None:  # the engine's own choice, so both paged systems use the same pages
        args.block_size = resolve_backend(args.attention_backend, first.device, None, first.dtype)[1]
    workload = sharegpt.build_workload(first.tokenizer, args.n, args.seed, args.max_prompt_len, args.max_output_len,
                                       tokenizer_name=first.name)
    kv_blocks = kv_blocks_for(workload, args.max_num_seqs, args.block_size)
    info = sharegpt.describe(workload)
    print(f"model {first.name} | {info['num_requests']} requests | prompt len mean {info['prompt_len']['mean']} "
          f"max {info['prompt_len']['max']} | output len mean {info['output_len']['mean']} "
          f"max {info['output_len']['max']} (total {info['output_len']['total']}) | KV blocks {kv_blocks}", flush=True)

    checks = {}
    if not args.skip_check:
        for d, lm in models.items():
            checks[d] = greedy_check(lm, workload, args.system_list, args, kv_blocks)

    runs: list[dict] = []
    combos = [(d, s) for d in args.dtypes for s in args.system_list]
    print(f"\n{'round':>5} {'system':<20} {'dtype':<9} {'wall s':>8} {'tok/s':>8} {'own cpu s':>10} "
          f"{'other cpu s':>12} {'other cores':>12}", flush=True)
    for rnd in range(args.repeats):
        shift = rnd % len(combos)  # rotate so no system always runs first or after the same neighbour
        for dtype, name in combos[shift:] + combos[:shift]:
            lm = models[dtype]
            result = system_runner(name, args, kv_blocks)(lm, workload)
            gc.collect()
            short = [i for i, (_, o) in enumerate(workload) if len(result.outputs.get(i, [])) != o]
            if short:
                print(f"WARNING: {name} returned wrong lengths for {len(short)} requests, e.g. #{short[0]}", flush=True)
            load = result.load
            rate = result.useful_tokens / load.wall_s
            runs.append({"round": rnd, "system": name, "dtype": dtype, "wall_s": round(load.wall_s, 3),
                         "useful_tokens": result.useful_tokens, "computed_tokens": result.computed_tokens,
                         "tokens_per_s": round(rate, 2), "wrong_length_requests": len(short),
                         "sysload": load.to_dict(), "extra": result.extra})
            own = "n/a" if load.own_cpu_s is None else f"{load.own_cpu_s:.1f}"
            other = "n/a" if load.other_cpu_s is None else f"{load.other_cpu_s:.1f}"
            cores = "n/a" if load.other_cores is None else f"{load.other_cores:.2f}"
            print(f"{rnd:>5} {name:<20} {dtype:<9} {load.wall_s:>8.2f} {rate:>8.1f} {own:>10} {other:>12} {cores:>12}",
                  flush=True)

    summary = summarize(runs, args.dtypes, args.system_list)
    print_summary(summary)
    total_s = time.perf_counter() - t_start
    print(f"\ntotal {total_s:.0f} s; 'other cpu s' = CPU seconds other processes used during the run "
          f"(of {sysload.LoadRecord().num_cpus} cores x wall): high values mean a disturbed measurement")
    record = {
        "benchmark": "throughput", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:], "config": args_config(args),
        "model": first.name, "model_revision": first.revision, "kv_blocks": kv_blocks,
        "workload": info, "environment": environment(), "greedy_check": checks,
        "runs": runs, "summary": summary, "total_s": round(total_s, 1),
    }
    write_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
