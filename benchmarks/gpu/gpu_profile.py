"""Where a continuous-batching step's time goes on CUDA without flash-attn (torch SDPA backend).

    python -m benchmarks.gpu.gpu_profile --model DIR [--n 128] [--max-output-len 256] [--profile-steps 60]

The eager SDPA path can be CPU-bound (one core busy for the whole run, the GPU mostly waiting),
its continuous steps far slower than its static ones. This runs the ShareGPT
workload of benchmarks.gpu.gpu_check (its cached lengths) three ways, interleaved: one SDPA call per
sequence in prefill steps; one padded call per kind (attention/padded_prefill.py); and that with
every decode sequence in one SDPA group too (no grouping by context length: on a GPU a
launch may cost more than the padding it saves). For each it prints the unprofiled rate, the step
times split into steps that carry prefill tokens and pure decode steps, and torch.profiler's top
ops by CPU self time and by device self time over the first `--profile-steps` steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.engine.attention import padded_prefill, sdpa
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import load_model
from batchgen.engine.request import Request, SamplingParams
from benchmarks import sharegpt
from benchmarks.peers import throughput

# name: (decode grouping ratio on the GPU, fewest sequences of a kind for a padded prefill call)
VARIANTS = {
    "per-sequence prefill": (2.0, 10**9),
    "padded prefill": (2.0, padded_prefill.MIN_PADDED_SEQS),
    "padded + one decode group": (float("inf"), padded_prefill.MIN_PADDED_SEQS),
}


def use(variant: str) -> None:
    sdpa.ACCELERATOR_DECODE_GROUP_MAX_RATIO, padded_prefill.MIN_PADDED_SEQS = VARIANTS[variant]


def make_engine(lm, workload, args) -> LLMEngine:
    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(
        max_num_seqs=256, max_num_batched_tokens=8192, block_size=16,
        num_kv_blocks=throughput.kv_blocks_for(workload, 256, 16), enable_prefix_caching=True))
    for i, (p, o) in enumerate(workload):
        engine.add_request(Request(str(i), list(p), SamplingParams(max_new_tokens=o, ignore_eos=True)))
    return engine


def timed_steps(engine: LLMEngine, max_steps: int | None = None) -> list[tuple[float, bool]]:
    """(seconds, had prefill tokens) per step, the device synchronized at each step's end."""
    runner_run = engine.runner.run
    kinds: list[bool] = []

    def run(out):
        kinds.append(out.num_batched_tokens > len(out.scheduled))
        return runner_run(out)

    engine.runner.run = run
    steps = []
    while engine.has_unfinished() and (max_steps is None or len(steps) < max_steps):
        t0 = time.perf_counter()
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
    return list(zip(steps, kinds, strict=False))


def describe(name: str, steps: list[tuple[float, bool]], num_tokens: int, wall_s: float) -> None:
    pre = [s for s, k in steps if k]
    dec = [s for s, k in steps if not k]
    print(f"{name}: {wall_s:.2f} s, {num_tokens / wall_s:.1f} tok/s, {len(steps)} steps; "
          f"prefill steps {len(pre)} sum {sum(pre):.2f} s (max {max(pre, default=0) * 1e3:.0f} ms); "
          f"decode steps {len(dec)} sum {sum(dec):.2f} s, p50 {statistics.median(dec) * 1e3 if dec else 0:.1f} ms, "
          f"max {max(dec, default=0) * 1e3:.1f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--profile-steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the glue")
    args = p.parse_args(argv)
    lm = load_model(args.model, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32")
    workload = sharegpt.build_workload(lm.tokenizer, args.n, 0, 512, args.max_output_len,
                                       tokenizer_name=lm.name)
    num_tokens = sum(o for _, o in workload)
    warm = make_engine(lm, workload[:8], args)
    timed_steps(warm, 8)
    del warm
    for _ in range(args.rounds):
        for name in VARIANTS:
            use(name)
            engine = make_engine(lm, workload, args)
            t0 = time.perf_counter()
            steps = timed_steps(engine)
            describe(name, steps, num_tokens, time.perf_counter() - t0)
            del engine
    for name in VARIANTS:
        use(name)
        engine = make_engine(lm, workload, args)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            steps = timed_steps(engine, args.profile_steps)
        describe(f"{name} (profiled, first {len(steps)} steps)", steps, 1, sum(s for s, _ in steps))
        table = prof.key_averages()
        print(f"--- {name}: top ops by CPU self time")
        print(table.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
        print(f"--- {name}: top ops by device self time")
        try:
            print(table.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
        except (KeyError, AttributeError):
            print(table.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
        del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
