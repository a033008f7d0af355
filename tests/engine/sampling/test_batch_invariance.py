"""In the real engine (a tiny random-weight float32 model): a sampled row's tokens are the same alone,
in any batch, in any order and under either policy, and a rerun without per-row seeds repeats itself."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.config.choices import Policy
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.95), dict(temperature=1.2, top_k=20),
            dict(temperature=0.7, min_p=0.1), dict(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.2),
            dict()]  # a greedy row among them


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny_model("llama").eval()


def engine(model, tokenizer, policy=Policy.CONTINUOUS, max_num_seqs=8) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(policy=policy, num_kv_blocks=128, block_size=4,
                                                    max_num_seqs=max_num_seqs, adaptive_threads=False),
                     eos_token_ids=[2])


def requests(n: int = 12, seeded: bool = True) -> list[Request]:
    rng = random.Random(3)
    return [Request(f"row-{i}", [rng.randrange(5, 261) for _ in range(rng.randint(2, 12))],
                    SamplingParams(max_new_tokens=24, seed=(77 + i if seeded else None), **SETTINGS[i % len(SETTINGS)]))
            for i in range(n)]


def tokens(eng: LLMEngine, reqs: list[Request]) -> dict[str, list[int]]:
    return {c.request_id: c.token_ids for c in eng.generate(reqs)}


@pytest.mark.parametrize("policy", [Policy.CONTINUOUS, Policy.STATIC])
def test_a_rows_tokens_do_not_depend_on_its_batch(model, tokenizer, policy):
    reqs = requests()
    together = tokens(engine(model, tokenizer, policy), reqs)
    assert len({tuple(t) for t in together.values()}) == len(reqs)
    alone = {}
    for r in reqs[:4]:
        alone.update(tokens(engine(model, tokenizer, policy, max_num_seqs=1), [r]))
    assert alone == {rid: together[rid] for rid in alone}
    shuffled = reqs[::-1]
    assert tokens(engine(model, tokenizer, policy, max_num_seqs=3), shuffled) == together


def test_a_rerun_without_seeds_repeats_itself_and_rows_differ(model, tokenizer):
    first = tokens(engine(model, tokenizer), requests(seeded=False))
    assert tokens(engine(model, tokenizer, max_num_seqs=5), requests(seeded=False)) == first
    sampled = [first[r.request_id] for r in requests(seeded=False) if not r.sampling.greedy]
    assert len({tuple(t) for t in sampled}) == len(sampled)
