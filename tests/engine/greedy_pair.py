"""Greedy tokens of `model.generate` and of our engine on the same model, for the quantization tests."""

from __future__ import annotations

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams

PROMPTS = [[5 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((1, 9, 30))]


def generate_and_engine_tokens(model, tokenizer, max_new_tokens: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """(generate's tokens, the engine's) per prompt of PROMPTS, EOS ignored. The references are taken
    first, on the model itself: quanto's frozen tensors do not deepcopy."""
    refs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    engine = LLMEngine(model, tokenizer,
                       EngineConfig(max_num_seqs=4, block_size=8, num_kv_blocks=32, attention_backend="torch"),
                       eos_token_ids=[])
    got = {c.request_id: c.token_ids for c in engine.generate(
        Request(str(i), p, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        for i, p in enumerate(PROMPTS))}
    return refs, [got[str(i)] for i in range(len(PROMPTS))]
