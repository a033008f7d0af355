"""Rows of different LoRA adapters in one engine: each row's greedy tokens equal PEFT's `generate`
with its adapter (the base model's for rows without one), token for token, under both policies,
chunked prefill, preemption and prefix caching over prompts that adapters share."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import pytest
import torch

from batchgen.config.choices import Policy
from batchgen.engine.admission import RequestRejected
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from tests.engine.test_engine_equivalence import hf_greedy
from tests.lora_adapters import ADAPTER_SPECS, make_adapters, peft_model
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ADAPTERS = [None, *ADAPTER_SPECS]  # rows cycle through the base and the three adapters
EOS = 2
SHARED_PREFIX_LEN = 32


@dataclass
class LoraCase:
    model: torch.nn.Module
    dirs: dict[str, str]
    prompts: list[list[int]]
    adapters: list[str | None]
    max_new_tokens: list[int]
    refs: list[list[int]]

    def requests(self) -> list[Request]:
        return [Request(str(i), p, SamplingParams(max_new_tokens=n), adapter=a)
                for i, (p, a, n) in enumerate(zip(self.prompts, self.adapters, self.max_new_tokens, strict=True))]

    def engine(self, tokenizer, **config) -> LLMEngine:
        return LLMEngine(copy.deepcopy(self.model), tokenizer, EngineConfig(lora_adapters=self.dirs, **config),
                         eos_token_ids=[EOS])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory) -> LoraCase:
    model = make_tiny_model(request.param, seed=3)
    dirs = make_adapters(model, tmp_path_factory.mktemp(f"lora-{request.param}"))
    rng = random.Random(7)
    shared = [rng.randrange(5, 261) for _ in range(SHARED_PREFIX_LEN)]
    prompts = [[rng.randrange(5, 261) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    # every adapter and the base on one shared prefix, and twice on one whole prompt: a block
    # cached for one of them must never serve another
    prompts += [shared + [rng.randrange(5, 261) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    prompts += [list(prompts[-1])] * 4
    adapters = [ADAPTERS[i % len(ADAPTERS)] for i in range(len(prompts))]
    max_new = [rng.randint(4, 16) for _ in prompts]
    references = {name: peft_model(model, path) for name, path in dirs.items()} | {None: model}
    refs = [hf_greedy(references[a], p, n, EOS) for p, a, n in zip(prompts, adapters, max_new, strict=True)]
    base = [hf_greedy(model, p, n, EOS) for p, n in zip(prompts, max_new, strict=True)]
    changed = sum(r != b for r, b, a in zip(refs, base, adapters, strict=True) if a is not None)
    assert changed >= 0.8 * sum(a is not None for a in adapters), "the adapters must change the output"
    return LoraCase(model, dirs, prompts, adapters, max_new, refs)


def run(case: LoraCase, tokenizer, **config) -> LLMEngine:
    engine = case.engine(tokenizer, **config)
    completions = {c.request_id: c for c in engine.generate(case.requests())}
    assert sorted(completions, key=int) == [str(i) for i in range(len(case.prompts))]
    wrong = {i: (case.adapters[i], completions[str(i)].token_ids, ref) for i, ref in enumerate(case.refs)
             if completions[str(i)].token_ids != ref}
    assert not wrong, wrong
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return engine


@pytest.mark.parametrize("policy", [Policy.CONTINUOUS, Policy.STATIC])
def test_mixed_adapters_equal_peft(case, tokenizer, policy):
    run(case, tokenizer, policy=policy, max_num_seqs=8, num_kv_blocks=256)


def test_chunked_prefill_and_preemption(case, tokenizer):
    engine = run(case, tokenizer, block_size=4, num_kv_blocks=30, max_num_batched_tokens=24, max_num_seqs=6)
    summary = engine.metrics.summary()
    assert summary["num_preemptions"] >= 1 and summary["tokens_per_step_max"] == 24


def test_prefix_cache_is_keyed_by_adapter(case, tokenizer):
    engine = run(case, tokenizer, block_size=8, max_num_seqs=4, num_kv_blocks=256)
    assert engine.metrics.summary()["num_prefix_hit_tokens"] >= SHARED_PREFIX_LEN
    bm = engine.block_manager
    # the shared prefix's first block is cached once per adapter (and once for the base), never shared
    shared_seq = [s for s in case.requests() if len(s.prompt_token_ids) > SHARED_PREFIX_LEN][-4:]
    first = tuple(shared_seq[0].prompt_token_ids[:8])
    holders = [b for b in bm.blocks if b.token_ids == first]
    assert len(holders) == len({r.adapter for r in shared_seq}) == 4


def test_unknown_adapter_is_rejected(case, tokenizer):
    engine = case.engine(tokenizer, num_kv_blocks=64)
    with pytest.raises(RequestRejected, match="unknown LoRA adapter 'nope'"):
        engine.add_request(Request("x", [5, 6, 7], adapter="nope"))
