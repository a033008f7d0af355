"""n samples per row against the same rows repeated: is the prompt prefilled once?

    OMP_NUM_THREADS=1 python -m benchmarks.end_to_end.n_samples [--dtype auto] [--repeats 2]

The embedded SmolLM2-135M, 16 prompts (pydoc topics, cut to --prompt-tokens), each asked for 4
samples (temperature 0.8, top-p 0.95, --max-new-tokens with ignore-EOS) three ways, round-robin:

    n4          16 requests with SamplingParams(n=4): the samples share the prompt's K/V blocks
    rows64      the 16 prompts as 64 requests (each prompt 4 times, own seeds), prefix cache on
    rows64-nopc the same 64 requests with the prefix cache off

Printed per way: prompt tokens the engine computed (engine metrics: num_prompt_tokens minus
num_prefix_hit_tokens; a preempted row would compute its prompt again, so preemptions are shown
too: the cache of 1280 blocks of 16 tokens holds all 64 sequences), all tokens computed (prefill and
decode: sum_batched_tokens), steps, and generated tokens/s over the generate call, min and median
of the repeats, with the machine's CPU seconds (all processes, /proc/stat) against the wall seconds
of each run: above 1 per wall second, something else was running beside our one thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import load_model
from batchgen.engine.request import Request, SamplingParams

NUM_PROMPTS, N = 16, 4


def busy_jiffies() -> int:
    """CPU time of the whole machine (every process), in clock ticks: other load shows up here."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pydoc_data.topics import topics

    loaded = load_model(None, device="cpu", dtype=args.dtype)
    tok = loaded.tokenizer
    texts = sorted(topics.values(), key=len, reverse=True)[:NUM_PROMPTS]
    prompts = [tok(t)["input_ids"][:args.prompt_tokens] for t in texts]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)

    def n4() -> list[Request]:
        return [Request(f"p{i}", p, dataclasses.replace(sampling, n=N, seed=100 + i))
                for i, p in enumerate(prompts)]

    def rows64() -> list[Request]:
        return [Request(f"p{i}-{s}", p, dataclasses.replace(sampling, seed=1000 * i + s))
                for i, p in enumerate(prompts) for s in range(N)]

    ways = {"n4": (n4, True), "rows64": (rows64, True), "rows64-nopc": (rows64, False)}
    results: dict[str, list[dict]] = {name: [] for name in ways}
    print(f"dtype {loaded.model.dtype}, {NUM_PROMPTS} prompts of {sum(map(len, prompts))} tokens in all, "
          f"n={N}, {args.max_new_tokens} new tokens each")
    for _ in range(args.repeats):
        for name, (make, prefix_caching) in ways.items():
            engine = LLMEngine(loaded.model, tok, EngineConfig(num_kv_blocks=1280, block_size=16, max_num_seqs=64,
                                                               enable_prefix_caching=prefix_caching,
                                                               adaptive_threads=False),
                               eos_token_ids=loaded.eos_token_ids)
            requests = make()
            busy0, t0 = busy_jiffies(), time.perf_counter()
            done = list(engine.generate(requests))
            wall = time.perf_counter() - t0
            machine_cpu_s = (busy_jiffies() - busy0) / 100  # every process's, ours included (1 thread)
            m = engine.metrics
            assert len(done) == NUM_PROMPTS * N
            results[name].append({
                "prompt_computed": m.num_prompt_tokens - m.num_prefix_hit_tokens, "prompt": m.num_prompt_tokens,
                "all_computed": m.sum_batched_tokens, "steps": m.num_steps, "preemptions": m.num_preemptions,
                "tok_s": sum(c.num_generated_tokens for c in done) / wall, "wall": wall,
                "machine_cpu_s": machine_cpu_s})
    print(f"{'way':<12} {'prompt tokens':>13} {'computed':>9} {'all computed':>12} {'steps':>6} "
          f"{'preempted':>9} {'tok/s min':>9} {'tok/s median':>12} {'machine CPU s / wall s':>23}")
    for name, runs in results.items():
        r = runs[0]
        rates = [x["tok_s"] for x in runs]
        load = ", ".join(f"{x['machine_cpu_s']:.1f}/{x['wall']:.1f}" for x in runs)
        print(f"{name:<12} {r['prompt']:>13} {r['prompt_computed']:>9} {r['all_computed']:>12} {r['steps']:>6} "
              f"{r['preemptions']:>9} {min(rates):>9.1f} {statistics.median(rates):>12.1f} {load:>23}")


if __name__ == "__main__":
    main()
