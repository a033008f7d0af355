"""Continuing a stopped row: prompt + its tokens so far prefilled, the same random stream at the same
position (the counter-based stream is keyed by the output index, which counts the continued tokens),
stop checks over the whole generation. The result must equal the uninterrupted row's."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from batchgen.config.choices import Policy
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Continuation, FinishReason, Request, SamplingParams
from tests.tiny import make_tiny_model

MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny_model("llama").eval()


def engine(model, tokenizer, policy=Policy.CONTINUOUS) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(policy=policy, num_kv_blocks=64, block_size=4, max_num_seqs=4,
                                                    adaptive_threads=False), eos_token_ids=[2])


def requests(sampling: SamplingParams, n: int = 6) -> list[Request]:
    """Seeded rows, or with seed=-1 unseeded ones (their seed then comes from the request id)."""
    rng = random.Random(1)
    return [Request(str(i), [rng.randrange(3, 60) for _ in range(rng.randint(2, 9))],
                    dataclasses.replace(sampling, seed=None if sampling.seed == -1 else 1000 + i)) for i in range(n)]


def run(eng: LLMEngine, reqs: list[Request], *, stop_after_steps: int | None = None):
    """Completions by request id; with stop_after_steps, stop there and also return what is in flight."""
    done, snapshot, steps = {}, {}, [0]

    class Stop(Exception):
        pass

    def between_steps():
        steps[0] += 1
        if stop_after_steps is not None and steps[0] == stop_after_steps:
            snapshot.update({r.request_id: c for r, c in eng.in_flight()})
            raise Stop

    try:
        for c in eng.generate(reqs, between_steps=between_steps):
            done[c.request_id] = c
    except Stop:
        pass
    return done, snapshot


@pytest.mark.parametrize("policy", [Policy.CONTINUOUS, Policy.STATIC])
@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
                                      SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.3, top_p=0.9),
                                      SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_k=8,
                                                     stop=("ab",)),
                                      SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, min_p=0.05,
                                                     frequency_penalty=0.5, seed=-1)],
                         ids=["greedy", "seeded", "seeded-stop", "unseeded-penalties"])
def test_continued_rows_equal_uninterrupted(model, tokenizer, one_thread, policy, sampling):
    reference, _ = run(engine(model, tokenizer, policy), requests(sampling))
    for stop_at in (3, 11, 25):
        first, in_flight = run(engine(model, tokenizer, policy), requests(sampling), stop_after_steps=stop_at)
        assert in_flight, "the stop should leave rows in flight"
        resumed = [dataclasses.replace(r, continuation=in_flight.get(r.request_id))
                   for r in requests(sampling) if r.request_id not in first]
        eng = engine(model, tokenizer, policy)
        second, _ = run(eng, resumed)
        eng.check_integrity()
        assert set(first) | set(second) == set(reference)
        for rid, c in {**first, **second}.items():
            ref = reference[rid]
            assert (c.token_ids, c.text, c.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason), rid
            assert c.num_generated_tokens == ref.num_generated_tokens
        # nothing generated twice: the second attempt samples only what the first had not
        num_continued = sum(len(in_flight[r.request_id].token_ids) for r in resumed if r.request_id in in_flight)
        assert eng.metrics.num_sampled_tokens == sum(second[r.request_id].num_generated_tokens
                                                     for r in resumed) - num_continued


def test_continuation_that_already_ends_finishes_on_admission(model, tokenizer, one_thread):
    """Tokens that already reach max_new_tokens (or end in EOS) finish without a step."""
    eng = engine(model, tokenizer)
    full = Request("a", [5, 6, 7], SamplingParams(max_new_tokens=3), continuation=Continuation((9, 10, 11)))
    eos = Request("b", [5, 6, 7], SamplingParams(max_new_tokens=9), continuation=Continuation((9, 2)))
    out = {c.request_id: c for c in eng.generate([full, eos])}
    assert out["a"].finish_reason is FinishReason.LENGTH and out["a"].token_ids == [9, 10, 11]
    assert out["b"].finish_reason is FinishReason.STOP and out["b"].token_ids == [9, 2]
    assert eng.metrics.num_sampled_tokens == 0
