"""Length-aware planning: job throughput of static, continuous and auto on a uniform and a mixed workload.

    python -m benchmarks.end_to_end.planner --quick --threads 1  # 32 requests, outputs <= 128 (32 uniform), 2 rounds
    python -m benchmarks.end_to_end.planner                      # 256 requests, outputs <= 512 (128 uniform), 3 rounds

Workloads (prompts: the first human turns of ShareGPT conversations, benchmarks/sharegpt.py):
  uniform  every row generates the same number of tokens (--uniform-output-len)
  mixed    each row generates its conversation's first answer length (capped at --max-output-len)

Systems, each a whole `run_job` (reading, planning, engine, Parquet commits), greedy with ignore-EOS
and a per-row max_new_tokens column, so every system generates exactly the same tokens:
  static             --mode static (rows sorted by predicted length: bucketed batches)
  static-unsorted    --mode static --no-sort-by-length (batches in input order; mixed workload only)
  continuous         --mode continuous (rows longest predicted output first)
  continuous-unsorted --mode continuous --no-sort-by-length (input order; mixed workload only)
  auto               --mode auto: the planner picks per window

With ignore-EOS every length is known exactly, so this measures bucketing and the mode rule with a
perfect predictor; the predictor's own error is measured by tests/jobs/planning/test_length.py.

Tokens/s = generated tokens / wall seconds of run_job (the model is loaded once, outside the timing).
Systems run round-robin in one process, --repeats rounds, the start rotating each round; each run
records the CPU time other processes took meanwhile (benchmarks/sysload.py). All systems get the same
KV cache: room for --batch-size of the longest requests, so neither policy preempts.

The planner's targets are checked and printed (informational, not asserted):
uniform: static >= 1.1x continuous; both: auto within 5% of the better fixed mode; mixed: static
(bucketed) >= 1.3x static-unsorted. The run also prints the static_min_occupancy the uniform
workload implies: static pays off where occupancy x (static / continuous on uniform) >= 1.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchgen.config.job import build_config
from batchgen.engine.attention.registry import resolve_backend
from batchgen.engine.kv.cache import KVCacheSpec
from batchgen.engine.model.loader import LoadedModel, load_model
from batchgen.io.inputs.discovery import InputFile
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.planning.length import LengthPredictor
from batchgen.jobs.planning.planner import PlannedRow, Planner
from batchgen.jobs.rows.rows import InputRow
from benchmarks import sharegpt, sysload
from benchmarks.common import args_config, environment, write_record

SYSTEMS = {
    "static": dict(mode="static"),
    "static-unsorted": dict(mode="static", sort_by_length=False),
    "continuous": dict(mode="continuous"),
    "continuous-unsorted": dict(mode="continuous", sort_by_length=False),
    "auto": dict(mode="auto"),
}
WORKLOAD_SYSTEMS = {"uniform": ["static", "continuous", "auto"],
                    "mixed": ["static", "static-unsorted", "continuous", "continuous-unsorted", "auto"]}
FULL = {"n": 256, "max_output_len": 512, "uniform_output_len": 128, "batch_size": 64, "repeats": 3}
QUICK = {"n": 32, "max_output_len": 128, "uniform_output_len": 32, "batch_size": 8, "repeats": 2}


def write_workload(path: Path, tokenizer, workload: sharegpt.Workload) -> int:
    """The workload as a job input: prompt text (decoded ids) and a per-row budget column."""
    texts = tokenizer.batch_decode([p for p, _ in workload], skip_special_tokens=True)
    pq.write_table(pa.table({"id": list(range(len(workload))), "text": texts,
                             "budget": [o for _, o in workload]}), path)
    return sum(o for _, o in workload)


def kv_bytes_for(lm: LoadedModel, workload: sharegpt.Workload, batch_size: int) -> int:
    """Room for the batch_size longest requests at full length, plus slack (a few tokens of
    re-tokenization drift included): no policy preempts."""
    _, block_size = resolve_backend("auto", lm.device, None, lm.model.dtype)  # the engine's: 256 with flash-attn
    per_seq = sorted((math.ceil((len(p) + o + 16) / block_size) for p, o in workload), reverse=True)
    need = sum(per_seq[:batch_size])
    blocks = need + max(8, need // 20)
    return blocks * KVCacheSpec.from_model_config(lm.model.config, lm.model.dtype, block_size).bytes_per_block


def job_config(src: Path, out: Path, lm_name: str, args, kv_bytes: int, **overrides):
    values = dict(inputs=[str(src)], output=str(out), model=lm_name, dtype=args.dtype, device=args.device, chat=False,
                  id_column="id", max_new_tokens_column="budget", max_new_tokens=args.max_output_len,
                  ignore_eos=True, batch_size=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=str(kv_bytes), quiet=True, overwrite=True, commit_every_s=0,
                  cuda_graphs=not args.no_cuda_graphs)
    values.update(overrides)
    return build_config(None, **values)


def planned_occupancy(workload: sharegpt.Workload, args, sort: bool) -> float:
    """The static occupancy the planner computes for the workload as one window (exact lengths)."""
    config = build_config(None, inputs=["x"], output="o", batch_size=args.batch_size, sort_by_length=sort,
                          ignore_eos=True)
    file = InputFile("workload", "parquet", len(workload))
    rows = [PlannedRow(InputRow(i, file, i, {}), list(p), o) for i, (p, o) in enumerate(workload)]
    return Planner(config, LengthPredictor({}, ignore_eos=True)).plan(rows).static_occupancy


def run_system(lm: LoadedModel, src: Path, out: Path, args, kv_bytes: int, system: str, **overrides
               ) -> tuple[dict, object]:
    config = job_config(src, out, lm.name, args, kv_bytes, **SYSTEMS[system], **overrides)
    with sysload.measure() as load:
        summary = run_job(config, loaded=lm)
    gc.collect()
    return summary, load


def check_outputs(out: Path, expected_tokens: int | None) -> tuple[int, dict]:
    table = pq.ParquetDataset(str(out)).read(columns=["id", "num_generated_tokens", "generated_text"])
    rows = table.to_pylist()
    got = sum(r["num_generated_tokens"] for r in rows)
    if expected_tokens is not None and got != expected_tokens:
        print(f"WARNING: {out.name} generated {got} tokens, expected {expected_tokens}", flush=True)
    return got, {r["id"]: r["generated_text"] for r in rows}


def summarize(runs: list[dict]) -> dict:
    summary: dict = {}
    for workload, systems in WORKLOAD_SYSTEMS.items():
        per = {}
        for name in systems:
            mine = [r for r in runs if r["workload"] == workload and r["system"] == name]
            if mine:
                rates = [r["tokens_per_s"] for r in mine]
                per[name] = {"runs": len(rates), "min": round(min(rates), 2),
                             "median": round(statistics.median(rates), 2), "max": round(max(rates), 2),
                             "steps": statistics.median(r["engine"]["num_steps"] for r in mine),
                             "step_ms": round(statistics.median(r["engine"]["step_ms_mean"] for r in mine), 2)}
        for s in per.values():
            if "continuous" in per:
                s["vs_continuous"] = round(s["median"] / per["continuous"]["median"], 3)
        summary[workload] = per
    return summary


def targets(summary: dict) -> dict:
    def med(w, s):
        return summary.get(w, {}).get(s, {}).get("median")

    out = {}
    u_static, u_cont = med("uniform", "static"), med("uniform", "continuous")
    if u_static and u_cont:
        out["uniform: static >= 1.1x continuous"] = (round(u_static / u_cont, 3), u_static >= 1.1 * u_cont)
    for w in ("uniform", "mixed"):
        fixed = [x for x in (med(w, "static"), med(w, "continuous")) if x is not None]
        auto = med(w, "auto")
        if auto and fixed:  # a workload left out by --workloads has no figures
            best = max(fixed)
            out[f"{w}: auto within 5% of the better fixed mode"] = (round(auto / best, 3), auto >= 0.95 * best)
    m_static, m_unsorted = med("mixed", "static"), med("mixed", "static-unsorted")
    if m_static and m_unsorted:
        out["mixed: static >= 1.3x static-unsorted"] = (round(m_static / m_unsorted, 3), m_static >= 1.3 * m_unsorted)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.end_to_end.planner", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF id, directory or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when present")
    p.add_argument("--n", type=int, help="requests per workload [256]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, help="mixed: cap of the ShareGPT answer lengths [512]")
    p.add_argument("--uniform-output-len", type=int, help="[128]")
    p.add_argument("--batch-size", type=int, help="static batch size and continuous concurrency [64]")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, help="[3]")
    p.add_argument("--workloads", default="uniform,mixed")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run decode steps eagerly")
    p.add_argument("--quick", action="store_true",
                   help="development preset: --n 32 --max-output-len 128 --uniform-output-len 32 --batch-size 8 "
                        "--repeats 2 (flags given override it)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():  # a flag given beats the preset
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workload_list:
        if w not in WORKLOAD_SYSTEMS:
            p.error(f"--workloads: unknown {w!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    t_start = time.perf_counter()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    args.device = lm.device.type  # the jobs run where the model was loaded
    mixed = sharegpt.build_workload(lm.tokenizer, args.n, args.seed, args.max_prompt_len, args.max_output_len,
                                    tokenizer_name=lm.name)
    workloads = {"uniform": [(p, args.uniform_output_len) for p, _ in mixed], "mixed": mixed}
    workloads = {w: workloads[w] for w in args.workload_list}
    tmp = Path(tempfile.mkdtemp(prefix="bench-planner-"))
    inputs, expected, kv, info = {}, {}, {}, {}
    for name, workload in workloads.items():
        inputs[name] = tmp / f"{name}.parquet"
        expected[name] = write_workload(inputs[name], lm.tokenizer, workload)
        kv[name] = kv_bytes_for(lm, workload, args.batch_size)
        info[name] = {**sharegpt.describe(workload), "kv_cache_bytes": kv[name],
                      "static_occupancy_sorted": round(planned_occupancy(workload, args, True), 4),
                      "static_occupancy_unsorted": round(planned_occupancy(workload, args, False), 4)}
        print(f"{name}: {len(workload)} requests | prompt len mean {info[name]['prompt_len']['mean']} | output len "
              f"mean {info[name]['output_len']['mean']} max {info[name]['output_len']['max']} | planned static "
              f"occupancy sorted {info[name]['static_occupancy_sorted']:.2f}, unsorted "
              f"{info[name]['static_occupancy_unsorted']:.2f}", flush=True)

    # warm-up: the first forwards allocate memory and pick kernels
    for name in workloads:
        for system in WORKLOAD_SYSTEMS[name]:
            run_system(lm, inputs[name], tmp / f"warm-{name}-{system}", args, kv[name], system,
                       max_rows=min(len(workloads[name]), args.batch_size))

    combos = [(w, s) for w in workloads for s in WORKLOAD_SYSTEMS[w]]
    runs: list[dict] = []
    first_texts: dict = {}
    print(f"\n{'round':>5} {'workload':<8} {'system':<19} {'wall s':>8} {'tok/s':>8} {'windows s/c':>11} "
          f"{'overruns':>8} {'steps':>6} {'ms/step':>8} {'other cpu s':>11} {'other cores':>11}", flush=True)
    for rnd in range(args.repeats):
        shift = rnd % len(combos)
        for workload, system in combos[shift:] + combos[:shift]:
            out = tmp / f"run-{rnd}-{workload}-{system}"
            summary, load = run_system(lm, inputs[workload], out, args, kv[workload], system)
            tokens, texts = check_outputs(out, expected[workload])
            shutil.rmtree(out)
            if rnd == 0:
                first_texts[(workload, system)] = texts
            rate = tokens / load.wall_s
            runs.append({"round": rnd, "workload": workload, "system": system, "wall_s": round(load.wall_s, 3),
                         "generated_tokens": tokens, "tokens_per_s": round(rate, 2),
                         "num_windows_static": summary.num_windows_static,
                         "num_windows_continuous": summary.num_windows_continuous,
                         "engine": {k: summary.engine.get(k) for k in (
                             "num_steps", "step_ms_mean", "step_ms_p50", "running_mean", "num_preemptions",
                             "num_overruns")},
                         "sysload": load.to_dict()})
            other = "n/a" if load.other_cpu_s is None else f"{load.other_cpu_s:.1f}"
            cores = "n/a" if load.other_cores is None else f"{load.other_cores:.2f}"
            print(f"{rnd:>5} {workload:<8} {system:<19} {load.wall_s:>8.2f} {rate:>8.1f} "
                  f"{summary.num_windows_static:>5}/{summary.num_windows_continuous:<5} "
                  f"{summary.engine.get('num_overruns', 0):>8} {summary.engine.get('num_steps', 0):>6} "
                  f"{summary.engine.get('step_ms_mean', 0):>8.1f} {other:>11} {cores:>11}", flush=True)

    mismatches = {}  # the equality gate: every system's greedy text equals continuous's (round 0)
    for (workload, system), texts in first_texts.items():
        base = first_texts[(workload, "continuous")]
        diff = [k for k in base if texts.get(k) != base[k]]
        if diff:
            mismatches[f"{workload}/{system}"] = len(diff)
            print(f"WARNING: {workload}/{system}: {len(diff)} rows' greedy text differs from continuous, e.g. id "
                  f"{diff[0]}", flush=True)
    summary = summarize(runs)
    # tokens/s = tokens / (steps x ms per step): which of the two a policy changes shows why it wins
    print(f"\n{'workload':<8} {'system':<19} {'runs':>4} {'min t/s':>9} {'med t/s':>9} {'max t/s':>9} {'vs cont':>8} "
          f"{'steps':>6} {'ms/step':>8}")
    for workload, per in summary.items():
        for name, s in per.items():
            print(f"{workload:<8} {name:<19} {s['runs']:>4} {s['min']:>9.1f} {s['median']:>9.1f} {s['max']:>9.1f} "
                  f"{s.get('vs_continuous', 0):>7.2f}x {s['steps']:>6.0f} {s['step_ms']:>8.1f}")
    checks = targets(summary)
    print()
    for label, (ratio, ok) in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  {label}: {ratio:.2f}")
    implied = None
    uniform = summary.get("uniform", {})
    if "static" in uniform and "continuous" in uniform:
        implied = round(min(1.0, uniform["continuous"]["median"] / uniform["static"]["median"]), 3)
        print(f"implied static_min_occupancy (continuous / static on uniform): {implied}")
    total_s = time.perf_counter() - t_start
    print(f"\ntotal {total_s:.0f} s; 'other cpu s' = CPU seconds other processes used during the run: high values "
          "mean a disturbed measurement")
    record = {"benchmark": "planner", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
              "config": args_config(args),
              "model": lm.name, "model_revision": lm.revision, "workloads": info, "environment": environment(),
              "greedy_mismatches": mismatches, "runs": runs, "summary": summary,
              "targets": {k: {"ratio": r, "met": ok} for k, (r, ok) in checks.items()},
              "implied_static_min_occupancy": implied, "total_s": round(total_s, 1)}
    write_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
