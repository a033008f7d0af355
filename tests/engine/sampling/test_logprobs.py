"""Logprobs equal log_softmax of the processed logits (penalties, temperature, truncation) to 1e-4 in
float32: in the sampler on fixed logits, and in the engine against the model's own forward."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sequence import Sequence
from tests.engine.sampling.test_draw import reference_kept
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SETTINGS = [dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=10), dict(temperature=1.3, top_p=0.8),
            dict(temperature=0.9, min_p=0.05), dict(temperature=1.1, top_k=40, top_p=0.9), dict(repetition_penalty=1.4)]


def expected_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log_softmax of one row's processed logits (no penalties here), in float32."""
    if params.greedy:
        return torch.log_softmax(logits, -1)
    x = logits / params.temperature
    keep = reference_kept(x, params.top_k or 0, params.top_p, params.min_p)
    return torch.log_softmax(x.masked_fill(~keep, float("-inf")), -1)


@pytest.mark.parametrize("window", [20, 256])
def test_sampler_logprobs_are_log_softmax_of_the_processed_logits(window):
    vocab_size, k = 300, 5
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(SETTINGS) * 3, vocab_size, generator=gen) * 3
    seqs = [Sequence.from_request(i, Request(str(i), [1], SamplingParams(
        logprobs=k, seed=i, **{key: v for key, v in SETTINGS[i % len(SETTINGS)].items()
                               if key != "repetition_penalty"}))) for i in range(logits.shape[0])]
    tokens = Sampler(window=window).sample(logits.clone(), seqs)
    for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
        (entry,) = seq.logprobs
        expected = expected_logprobs(logits[i], seq.request.sampling)
        assert entry.token_id == token
        assert abs(entry.logprob - expected[token].item()) < 1e-4, i
        top = torch.topk(expected, k)
        want = [(t, v) for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True) if v > float("-inf")]
        assert [t for t, _ in entry.top] == [t for t, _ in want], i
        assert max(abs(a - b) for (_, a), (_, b) in zip(entry.top, want, strict=True)) < 1e-4, i


def test_rows_without_logprobs_get_none_and_top_zero_is_the_chosen_token_only():
    logits = torch.randn(3, 50)
    seqs = [Sequence.from_request(0, Request("0", [1], SamplingParams(temperature=1.0, seed=1))),
            Sequence.from_request(1, Request("1", [1], SamplingParams(temperature=1.0, seed=1, logprobs=0))),
            Sequence.from_request(2, Request("2", [1], SamplingParams(logprobs=0)))]
    Sampler().sample(logits, seqs)
    assert seqs[0].logprobs == []
    assert len(seqs[1].logprobs) == 1 and seqs[1].logprobs[0].top == ()
    assert len(seqs[2].logprobs) == 1 and seqs[2].logprobs[0].top == ()


def test_engine_logprobs_match_the_models_forward(tokenizer):
    model = make_tiny_model("llama", seed=0).eval()
    rng = random.Random(0)
    requests = [Request(str(i), [rng.randrange(5, 261) for _ in range(rng.randint(3, 20))],
                        SamplingParams(max_new_tokens=12, logprobs=3, seed=100 + i, **SETTINGS[i % len(SETTINGS)]))
                for i in range(len(SETTINGS))]
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4,
                                                                     adaptive_threads=False), eos_token_ids=[2])
    done = {c.request_id: c for c in engine.generate(requests)}
    for r in requests:
        c = done[r.request_id]
        assert c.logprobs is not None and [e.token_id for e in c.logprobs] == c.token_ids
        with torch.no_grad():
            ids = torch.tensor([r.prompt_token_ids + c.token_ids])
            model_logits = model(ids).logits[0, len(r.prompt_token_ids) - 1:-1]  # the logits each token was drawn from
        for t, entry in enumerate(c.logprobs):
            row = model_logits[t]
            if r.sampling.repetition_penalty != 1.0:
                seen = sorted(set(r.prompt_token_ids + c.token_ids[:t]))
                vals = row[seen]
                row = row.clone()
                row[seen] = torch.where(vals > 0, vals / r.sampling.repetition_penalty,
                                        vals * r.sampling.repetition_penalty)
            expected = expected_logprobs(row, r.sampling)
            assert abs(entry.logprob - expected[entry.token_id].item()) < 1e-4, (r.request_id, t)
            assert [tok for tok, _ in entry.top] == torch.topk(expected, len(entry.top)).indices.tolist()
