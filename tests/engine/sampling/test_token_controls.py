"""vLLM's logit_bias and allowed_token_ids in the engine: greedy rows equal
model.generate with the same bias (transformers' sequence_bias) or the same allowed set
(prefix_allowed_tokens_fn), token for token; sampled rows draw only allowed tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sequence import Sequence
from tests.engine.sampling.test_vllm_controls import _draws
from tests.tiny import BYTE_OFFSET, make_tiny_model

MAX_NEW = 10
PROMPTS = [[BYTE_OFFSET + b for b in text] for text in (b"token controls", b"a", b"bias the logits of rows")]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=0)


def engine_tokens(model, tokenizer, **sampling) -> list[list[int]]:
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(kv_cache_bytes=4 * 2**20), eos_token_ids=[])
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, **sampling)
    done = {c.request_id: c.token_ids for c in engine.generate(Request(str(i), p, params)
                                                                for i, p in enumerate(PROMPTS))}
    return [done[str(i)] for i in range(len(PROMPTS))]


def generate_tokens(model, **kwargs) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=None, pad_token_id=0, **kwargs)
        out.append(gen[0, len(p):].tolist())
    return out


def test_logit_bias_equals_generate_with_the_same_bias(model, tokenizer):
    free = engine_tokens(model, tokenizer)
    # push down the free run's favourite tokens and lift two others a little: the text changes
    bias = {free[0][0]: -100.0, free[2][1]: -5.0, BYTE_OFFSET + ord("x"): 3.0, BYTE_OFFSET + ord("q"): 2.5}
    got = engine_tokens(model, tokenizer, logit_bias=tuple(sorted(bias.items())))
    want = generate_tokens(model, sequence_bias={(t,): b for t, b in bias.items()})
    assert got == want
    assert got != free and free[0][0] not in got[0]


def test_allowed_token_ids_equal_generate_with_the_same_allowed_set(model, tokenizer):
    allowed = sorted(BYTE_OFFSET + b for b in b"aeiou ")
    got = engine_tokens(model, tokenizer, allowed_token_ids=tuple(allowed))
    want = generate_tokens(model, prefix_allowed_tokens_fn=lambda _batch, _ids: allowed)
    assert got == want
    assert all(t in allowed for row in got for t in row)


def test_sampled_rows_draw_only_allowed_tokens_and_the_bias_moves_them():
    sampler = Sampler()
    logits = torch.zeros(1, 50)
    allowed = (3, 7, 11)
    seq = Sequence.from_request(0, Request("0", [1], SamplingParams(temperature=1.0, seed=5, allowed_token_ids=allowed,
                                                                    logit_bias=((7, 100.0),))))
    sampler.add(seq)
    assert set(_draws(sampler, logits, seq, 50)) == {7}  # +100 on an allowed token all but forces it
    plain = Sequence.from_request(1, Request("1", [1], SamplingParams(temperature=1.0, seed=5,
                                                                      allowed_token_ids=allowed)))
    sampler.add(plain)
    assert set(_draws(sampler, logits, plain, 200)) == set(allowed)


def test_ids_beyond_the_vocabulary_change_nothing():
    sampler = Sampler()
    logits = torch.randn(1, 20)
    seq = Sequence.from_request(0, Request("0", [1], SamplingParams(logit_bias=((500, 50.0),))))
    sampler.add(seq)
    assert sampler.sample(logits.clone(), [seq]) == [int(logits[0].argmax())]
