"""LoRA rows on a Mistral-shaped model (sliding window) and a Gemma-shaped one (GELU MLP, (1 + w)
norms, query scaling, local and global layers in KV groups): each row's greedy tokens equal PEFT's
`generate` with its adapter, token for token in float32, with the adapters applied as one stacked
pass per layer (decode-sized steps) and as one pair per adapter (prefill-sized steps)."""

from __future__ import annotations

import copy
import random

import pytest

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.lora import layers
from batchgen.engine.request import Request, SamplingParams
from tests.engine.test_engine_equivalence import hf_greedy
from tests.engine.test_families_generate import SHIPPED, WINDOW, build
from tests.lora_adapters import ADAPTER_SPECS, make_adapters, peft_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ADAPTERS = [None, *ADAPTER_SPECS]  # rows cycle through the base and the three adapters
MAX_NEW_TOKENS = 12
FAMILIES = [f for f in ("mistral", "gemma3", "gemma2") if f in SHIPPED][:2]


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    model = build(request.param, seed=3)
    dirs = make_adapters(model, tmp_path_factory.mktemp(f"lora-{request.param}"))
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 261) for _ in range(n)] for n in (1, 5, WINDOW + 3, 30, 9, 41, 17, 2)]
    adapters = [ADAPTERS[i % len(ADAPTERS)] for i in range(len(prompts))]
    references = {name: peft_model(model, path) for name, path in dirs.items()} | {None: model}
    refs = [hf_greedy(references[a], p, MAX_NEW_TOKENS, eos=None) for p, a in zip(prompts, adapters, strict=True)]
    base = [hf_greedy(model, p, MAX_NEW_TOKENS, eos=None) for p in prompts]
    assert all(r != b for r, b, a in zip(refs, base, adapters, strict=True) if a), "the adapters must change the output"
    return request.param, model, dirs, prompts, adapters, refs


@pytest.mark.parametrize("stacked", [True, False])
def test_rows_equal_peft_generate(case, tokenizer, monkeypatch, stacked):
    name, model, dirs, prompts, adapters, refs = case
    if not stacked:
        monkeypatch.setattr(layers, "STACKED_MAX_TOKENS", 0)
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(
        lora_adapters=dirs, block_size=4, num_kv_blocks=128, max_num_seqs=5, max_num_batched_tokens=32),
        eos_token_ids=[])
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True), adapter=a)
                for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]
    got = {c.request_id: c.token_ids for c in engine.generate(requests, between_steps=engine.check_integrity)}
    wrong = {i: (adapters[i], got[str(i)], ref) for i, ref in enumerate(refs) if got[str(i)] != ref}
    assert not wrong, f"{name}: {wrong}"
    assert (engine.kv_groups is not None) == name.startswith("gemma")
