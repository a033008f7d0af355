"""`batchgen bench`: engine throughput on this machine, continuous against static, one process.

A synthetic workload of random prompt tokens and ignore-EOS outputs, so every policy generates
exactly the same tokens; lengths are either uniform or mixed (log-normal, heavy-tailed like chat
answers). The policies run round-robin over `repeats` rounds and report min and median
generated tokens/s. Comparisons with transformers live in the repository's benchmarks/.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

from batchgen.config.choices import Policy
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import LoadedModel, load_model
from batchgen.engine.request import Request, SamplingParams
from batchgen.monitor.trace import StepTrace


@dataclass(frozen=True, slots=True)
class BenchWorkload:
    prompt_token_ids: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, *, mean_prompt_tokens: int, mean_output_tokens: int, mixed: bool,
                  vocab_size: int, seed: int = 0, max_tokens: int = 2048) -> BenchWorkload:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        if not mixed:
            return mean
        # log-normal with sigma 1: heavy-tailed, median ~ mean / 1.65
        return max(1, min(max_tokens, int(rng.lognormvariate(math.log(mean) - 0.5, 1.0))))

    prompts, outputs = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(10, vocab_size) for _ in range(length(mean_prompt_tokens))])
        outputs.append(length(mean_output_tokens))
    return BenchWorkload(prompts, outputs)


def run_once(loaded: LoadedModel, workload: BenchWorkload, engine_config: EngineConfig,
             trace: StepTrace | None = None) -> dict:
    engine = LLMEngine(loaded.model, loaded.tokenizer, engine_config, eos_token_ids=loaded.eos_token_ids)
    if trace is not None:
        engine.metrics.listeners.append(trace)
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(workload.prompt_token_ids, workload.output_lens, strict=True))]
    started = time.perf_counter()
    num_tokens = sum(len(c.token_ids) for c in engine.generate(requests))
    wall_s = time.perf_counter() - started
    assert num_tokens == workload.num_output_tokens, "ignore-EOS runs must generate every requested token"
    summary = engine.metrics.summary()
    return {"wall_s": round(wall_s, 3), "tokens_per_s": round(num_tokens / wall_s, 2),
            "step_ms_p50": summary["step_ms_p50"], "running_mean": summary["running_mean"],
            "num_preemptions": summary["num_preemptions"]}


def run_bench(loaded: LoadedModel, workload: BenchWorkload, engine_configs: dict[str, EngineConfig],
              repeats: int, traces: dict[str, StepTrace] | None = None) -> dict:
    """`traces`, if given, receives each policy's last run, step by step (the --report figures)."""
    runs: dict[str, list[dict]] = {name: [] for name in engine_configs}
    names = list(engine_configs)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            trace = StepTrace() if traces is not None and r == repeats - 1 else None
            runs[name].append(run_once(loaded, workload, engine_configs[name], trace))
            if trace is not None:
                traces[name] = trace
    result = {}
    for name, rs in runs.items():
        tps = [x["tokens_per_s"] for x in rs]
        result[name] = {"runs": rs, "tokens_per_s_min": min(tps), "tokens_per_s_median": statistics.median(tps)}
    return result


def default_engine_configs(batch_size: int, max_num_batched_tokens: int, kv_cache_bytes: int | None) -> dict:
    common = dict(max_num_seqs=batch_size, max_num_batched_tokens=max_num_batched_tokens,
                  kv_cache_bytes=kv_cache_bytes)
    return {"continuous": EngineConfig(policy=Policy.CONTINUOUS, **common),
            "static": EngineConfig(policy=Policy.STATIC, **common)}


@dataclass
class BenchOutcome:
    """What `batchgen bench` prints and reports: the model it ran, the workload, each policy's runs."""

    model_label: str  # name, dtype and device, as the report's facts and the summary line show them
    workload: BenchWorkload
    result: dict
    traces: dict[str, StepTrace] | None


def bench_model(model: str | None, *, device: str, dtype: str, num_requests: int, prompt_tokens: int,
                output_tokens: int, uniform: bool, batch_size: int, max_num_batched_tokens: int,
                kv_cache_bytes: int | None, repeats: int, trace: bool) -> BenchOutcome:
    """Load `model` and compare the policies on one synthetic workload sized to its context."""
    loaded = load_model(model, device=device, dtype=dtype)
    workload = make_workload(num_requests, mean_prompt_tokens=prompt_tokens, mean_output_tokens=output_tokens,
                             mixed=not uniform, vocab_size=len(loaded.tokenizer),
                             max_tokens=loaded.max_context_tokens // 2)
    traces: dict | None = {} if trace else None
    result = run_bench(loaded, workload, default_engine_configs(batch_size, max_num_batched_tokens, kv_cache_bytes),
                       repeats, traces)
    label = f"{loaded.name} {str(loaded.dtype).removeprefix('torch.')} on {loaded.device}"
    return BenchOutcome(label, workload, result, traces)
