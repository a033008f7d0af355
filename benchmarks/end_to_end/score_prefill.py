"""--task score's token rate against the engine's own prefill rate: same model, same real prompts, one process,
interleaved rounds, medians.

    python -m benchmarks.end_to_end.score_prefill                       # 64 prompts, 2 rounds, the default model
    python -m benchmarks.end_to_end.score_prefill --prompts 128 --rounds 3 --dtype float32

Prompts: pydoc paragraphs and ShareGPT first prompts (benchmarks/peers/embed.py's rows), tokenized by the model's
tokenizer, cut to --max-tokens. Per round, in alternating order:
- prefill: LLMEngine.generate with max_new_tokens=1 at default engine flags: each prompt's whole forward, the LM head on
  its last token, one sampled token, no decode step;
- score: the Encoder of `--task score` on the same prompts (every token after the first scored: the LM head and its
  log-softmax at every position).
Both rates are prompt tokens per second of the call alone (models loaded and warmed up before the rounds), on the
same pinned number of threads: the engine's adaptive thread count (runtime/threads.py) is off here, since it follows
the machine's load and would leave each system another count on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from batchgen.config.choices import Task
from batchgen.engine.encode.encoder import Encoder, EncodeRequest
from batchgen.engine.encode.load import load_encode_model
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import load_model
from batchgen.engine.request import Request, SamplingParams
from benchmarks.peers.embed import rows


def prefill_rate(loaded, prompts: list[list[int]]) -> float:
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(adaptive_threads=False),
                       eos_token_ids=loaded.eos_token_ids)
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=1, ignore_eos=True)) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    list(engine.generate(requests))
    return sum(map(len, prompts)) / (time.perf_counter() - started)


def score_rate(model, prompts: list[list[int]]) -> tuple[float, Encoder]:
    encoder = Encoder(model)
    started = time.perf_counter()
    results = list(encoder.run(EncodeRequest(str(i), tuple(p)) for i, p in enumerate(prompts)))
    assert len(results) == len(prompts)
    return sum(map(len, prompts)) / (time.perf_counter() - started), encoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(None, device="cpu", dtype=args.dtype)
    scorer = load_encode_model(None, Task.SCORE, dtype=args.dtype, device="cpu")
    texts = rows(args.prompts // 2, args.prompts - args.prompts // 2)
    prompts = [ids[:args.max_tokens] for ids in loaded.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    prompts = [p for p in prompts if len(p) >= 2]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens (longest {max(map(len, prompts))}), "
          f"dtype {loaded.dtype}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}",
          flush=True)
    prefill_rate(loaded, prompts[:4])  # warm-up: kernel builds, oneDNN's caches
    score_rate(scorer, prompts[:4])
    prefill, score = [], []
    encoder = None
    for r in range(args.rounds):
        for name in (("prefill", "score") if r % 2 == 0 else ("score", "prefill")):
            assert torch.get_num_threads() == args.threads
            if name == "prefill":
                prefill.append(prefill_rate(loaded, prompts))
            else:
                rate, encoder = score_rate(scorer, prompts)
                score.append(rate)
        print(f"round {r}: prefill {prefill[-1]:.0f} tok/s, score {score[-1]:.0f} tok/s, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
    p, s = statistics.median(prefill), statistics.median(score)
    print(f"median: prefill {p:.0f} tok/s, score {s:.0f} tok/s, score / prefill {s / p:.2f}x")
    print(f"padding waste: linears {encoder.padding_waste:.3f}, attention layout "
          f"{encoder.num_attention_tokens / encoder.num_needed_tokens:.3f} tokens run per token needed "
          f"({encoder.num_batches} batches)")


if __name__ == "__main__":
    main()
