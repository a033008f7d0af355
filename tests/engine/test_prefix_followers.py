"""Rows that name a prefix leader in the real engine (a tiny random-weight float32 model): greedy
output is token for token what each row gives without one, and the document's shared blocks are
computed once, under both policies, with chunked prefill and with preemption."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.config.choices import Policy
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BS = 4
SHARED = 16  # each document's 18 tokens: 4 full blocks shared by its rows
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny_model("llama").eval()


def engine(model, tokenizer, policy, *, num_kv_blocks=128, budget=None, max_num_seqs=8, prefix_caching=True):
    return LLMEngine(model, tokenizer, EngineConfig(
        policy=policy, num_kv_blocks=num_kv_blocks, block_size=BS, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching, adaptive_threads=False),
        eos_token_ids=[2])


def rows(num_docs: int = 3) -> list[Request]:
    """Each document's 4 questions, a document's rows together, its first row leading the others."""
    out = []
    for d in range(num_docs):
        document = [5 + d] + [10 + (d * 13 + i * 29) % 240 for i in range(17)]
        for q in range(4):
            out.append(Request(f"d{d}q{q}", document + [200 + q, 220 + d, 230 + q][:1 + q % 3], GREEDY,
                               prefix_leader_id=None if q == 0 else f"d{d}q0"))
    return out


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    """Every row alone in its own engine with no prefix cache."""
    return {r.request_id: c.token_ids for r in rows()
            for c in engine(model, tokenizer, Policy.CONTINUOUS, prefix_caching=False).generate(
                [dataclasses.replace(r, prefix_leader_id=None)])}


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("budget", [None, 8])  # 8: prompts prefilled in chunks
def test_followers_start_from_the_leaders_blocks_and_give_the_same_tokens(model, tokenizer, reference, policy,
                                                                            budget):
    eng = engine(model, tokenizer, policy, budget=budget)
    done = {c.request_id: c for c in eng.generate(rows())}
    assert {k: c.token_ids for k, c in done.items()} == reference
    for k, c in done.items():
        assert c.num_cached_prompt_tokens == (0 if k.endswith("q0") else SHARED), k
    # computed: each document once by its leader, each follower its own question, then the decode
    prompts = sum(c.num_prompt_tokens for c in done.values()) - 9 * SHARED
    assert eng.metrics.sum_batched_tokens == prompts + sum(c.num_generated_tokens - 1 for c in done.values())
    eng.check_integrity()


def test_preempted_rows_still_give_the_same_tokens_and_share_the_document(model, tokenizer, reference):
    eng = engine(model, tokenizer, Policy.CONTINUOUS, num_kv_blocks=22, budget=8)
    done = {c.request_id: c for c in eng.generate(rows())}
    assert eng.metrics.num_preemptions > 0
    assert {k: c.token_ids for k, c in done.items()} == reference
    assert all(c.num_cached_prompt_tokens == SHARED for k, c in done.items() if not k.endswith("q0"))


def test_without_leaders_rows_admitted_together_compute_the_document_each(model, tokenizer, reference):
    eng = engine(model, tokenizer, Policy.CONTINUOUS)
    done = {c.request_id: c for c in eng.generate([dataclasses.replace(r, prefix_leader_id=None) for r in rows()])}
    assert {k: c.token_ids for k, c in done.items()} == reference
    assert sum(c.num_cached_prompt_tokens for c in done.values()) < 9 * SHARED
