"""KV memory that follows the window: with a sliding window on every layer, a sequence holds only
the blocks its next query can still see, so the same cache runs several times the concurrent long
sequences of a full-attention model, with the same tokens as `model.generate`."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import _common

WINDOW = 12
PROMPT_LEN = 8 * WINDOW  # prompts of 8x the window
MAX_NEW_TOKENS = 48

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def mistral(sliding_window: int | None):
    torch.manual_seed(5)
    config = MistralConfig(**_common(sliding_window=sliding_window))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(model, tokenizer, prompts, config: EngineConfig):
    """(tokens per request, the most sequences running at once, the engine)"""
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    peak = [0]

    def between_steps():
        peak[0] = max(peak[0], len(engine.scheduler.running))
        engine.check_integrity()

    requests = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
                for i, p in enumerate(prompts)]
    got = {c.request_id: c.token_ids for c in engine.generate(requests, between_steps=between_steps)}
    return [got[str(i)] for i in range(len(prompts))], peak[0], engine


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_a_window_model_runs_three_times_the_concurrent_sequences_of_full_attention(backend, tokenizer):
    # measured here: 18 sequences at once against 3 (the goal: >= 3x at prompts >= 4x the window)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 261) for _ in range(PROMPT_LEN)] for _ in range(24)]
    config = EngineConfig(attention_backend=backend, block_size=4, num_kv_blocks=72, max_num_seqs=24,
                          max_num_batched_tokens=48, enable_prefix_caching=False)
    windowed, full = mistral(WINDOW), mistral(None)
    got_windowed, peak_windowed, engine = run(windowed, tokenizer, prompts, config)
    got_full, peak_full, _ = run(full, tokenizer, prompts, config)
    assert engine.kv_window == WINDOW
    assert got_windowed == [greedy(windowed, p) for p in prompts]
    assert got_full == [greedy(full, p) for p in prompts]
    assert peak_windowed >= 3 * peak_full, (peak_windowed, peak_full)


def test_prefix_hits_and_preemption_under_a_dropping_window(tokenizer):
    """Shared prefixes longer than the window (their early blocks dropped, then hit again while
    still cached) and a cache tight enough to preempt: the tokens stay generate's."""
    rng = random.Random(4)
    shared = [rng.randrange(5, 261) for _ in range(3 * WINDOW)]
    prompts = [shared + [rng.randrange(5, 261) for _ in range(rng.randint(1, 20))] for _ in range(10)]
    prompts += [[rng.randrange(5, 261) for _ in range(rng.randint(1, 70))] for _ in range(6)]
    model = mistral(WINDOW)
    config = EngineConfig(block_size=4, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=20)
    got, _, engine = run(model, tokenizer, prompts, config)
    assert got == [greedy(model, p) for p in prompts]
    summary = engine.metrics.summary()
    assert summary["num_prefix_hit_tokens"] > 0 and summary["num_preemptions"] >= 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_layer_that_attends_past_the_dropped_blocks_is_an_error_not_a_wrong_answer(tokenizer):
    from transformers import Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**_common(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(block_size=4, num_kv_blocks=64), eos_token_ids=[])
    assert engine.kv_window == WINDOW
    engine.model.model.layers[1].self_attn.sliding_window = None  # now disagrees with what the cache keeps
    with pytest.raises(RuntimeError, match="keeps only the last 12"):
        list(engine.generate([Request("r", list(range(5, 40)), SamplingParams(max_new_tokens=2))]))
    model.model.layers[0].self_attn.sliding_window = 7  # seen at engine start: all KV is kept
    assert LLMEngine(model, tokenizer, EngineConfig(block_size=4, num_kv_blocks=64)).kv_window is None
