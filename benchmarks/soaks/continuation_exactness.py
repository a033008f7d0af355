"""Is a continued row identical to the uninterrupted one on a real model? And is the engine batch-invariant?

    OMP_NUM_THREADS=1 python -m benchmarks.soaks.continuation_exactness --dtype float32
    OMP_NUM_THREADS=1 python -m benchmarks.soaks.continuation_exactness --dtype auto      # bf16 on this CPU

The embedded SmolLM2-135M, 4 prompts, 96 tokens each (ignore-EOS), batch 4. Continuation: stop the
engine after step 17 and after step 60 (LLMEngine.in_flight, as a SIGTERM checkpoint does), continue
the rows in a fresh engine, compare token ids with the uninterrupted run, greedy and seeded top-p.
Batch invariance: the same rows batched 4 vs 1 at a time. Printed: per row, the first token index
where the two differ (None: identical). Exactness of a continuation can be no better than the
engine's batch invariance: both change how the same tokens' K/V are computed.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import load_model
from batchgen.engine.request import Request, SamplingParams

TEXTS = ["Write a long story about a lighthouse keeper.", "Explain how a bicycle works, in detail.",
         "List the planets and describe each one.", "Summarize the history of the printing press."]


class _Stop(Exception):
    pass


def first_differences(a: dict, b: dict) -> list[int | None]:
    return [next((i for i, (x, y) in enumerate(zip(a[k], b[k], strict=True)) if x != y), None) for k in a]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None, device="cpu", dtype=args.dtype)
    tok = loaded.tokenizer
    print("dtype", loaded.model.dtype)

    def engine(max_num_seqs: int = 4) -> LLMEngine:
        return LLMEngine(loaded.model, tok, EngineConfig(num_kv_blocks=256, max_num_seqs=max_num_seqs,
                                                         adaptive_threads=False), eos_token_ids=loaded.eos_token_ids)

    def requests(sampling: SamplingParams) -> list[Request]:
        return [Request(str(i), tok(t)["input_ids"], dataclasses.replace(sampling, seed=11 + i))
                for i, t in enumerate(TEXTS)]

    for name, sampling in [("greedy", SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)),
                           ("seeded", SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8,
                                                     top_p=0.95, ignore_eos=True))]:
        reference = {c.request_id: c.token_ids for c in engine().generate(requests(sampling))}
        one_at_a_time = {c.request_id: c.token_ids for c in engine(1).generate(requests(sampling))}
        print(name, "batch 4 vs 1: first differing token", first_differences(reference, one_at_a_time))
        for stop_at in (17, 60):
            first, snapshot, steps, done = engine(), {}, [0], {}

            def hook(first=first, snapshot=snapshot, steps=steps, stop_at=stop_at):
                steps[0] += 1
                if steps[0] == stop_at:
                    snapshot.update({r.request_id: c for r, c in first.in_flight()})
                    raise _Stop

            try:
                for c in first.generate(requests(sampling), between_steps=hook):
                    done[c.request_id] = c.token_ids
            except _Stop:
                pass
            rest = [dataclasses.replace(r, continuation=snapshot.get(r.request_id))
                    for r in requests(sampling) if r.request_id not in done]
            for c in engine().generate(rest):
                done[c.request_id] = c.token_ids
            print(name, f"stopped after step {stop_at}, continued: first differing token",
                  first_differences(reference, done))


if __name__ == "__main__":
    main()
