"""Greedy tokens of `model.generate` and of our engine on the same model, for the quantization tests."""

from __future__ import annotations

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams

PROMPTS = [[5 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((1, 9, 30))]


def generate_tokens(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`model.generate`'s greedy new tokens per prompt, one prompt at a time, EOS ignored."""
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


def generate_and_engine_tokens(model, tokenizer, max_new_tokens: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """(generate's tokens, the engine's) per prompt of PROMPTS, EOS ignored. The references are taken
    first, on the model itself: quanto's frozen tensors do not deepcopy."""
    refs = generate_tokens(model, PROMPTS, max_new_tokens)
    engine = LLMEngine(model, tokenizer,
                       EngineConfig(max_num_seqs=4, block_size=8, num_kv_blocks=32, attention_backend="sdpa"),
                       eos_token_ids=[])
    got = {c.request_id: c.token_ids for c in engine.generate(
        Request(str(i), p, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        for i, p in enumerate(PROMPTS))}
    return refs, [got[str(i)] for i in range(len(PROMPTS))]
