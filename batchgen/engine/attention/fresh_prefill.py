"""Prompts with no cached past, attended in one padded SDPA call instead of one call each.

On a GPU without flash-attn every SDPA call is a few kernel launches driven from Python, and a
prefill step of a continuous batch holds dozens of prompts: one call per prompt and layer makes
the step CPU-bound while the device waits. Prompts that start from an empty cache need no page
gather: their new K/V are the whole context. Right-padded to the longest and run with is_causal,
every real query sees only keys at or before its own position, all of them real, so no mask is
needed and each row's result is the one a call of its own gives (the padded positions add exact
zeros to the softmax sums). The padded rows' outputs are dropped.

Only layers with plain scores take this path (no sliding window, softcap or sinks, unquantized
pages): those need masks or explicit scores, and keep the per-prompt calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.engine.attention.base import PackedSeq

# below this many fresh prompts in a step the per-prompt calls are as cheap
MIN_FRESH_PROMPTS = 2


@dataclass(slots=True)
class FreshBatch:
    num_prompts: int
    max_len: int  # the longest fresh prompt's new tokens: the padded length
    gather_idx: torch.Tensor  # [num_prompts * max_len] packed-row index per padded slot (padding: its prompt's first)
    valid_idx: torch.Tensor  # [num_real] padded slots that hold a real token, in packed-row order of dest_idx
    dest_idx: torch.Tensor  # [num_real] their packed-row positions
    starts: frozenset[int]  # the fresh prompts' first packed positions (the per-prompt path skips them)


def build_fresh_batch(seqs: list[PackedSeq], device: torch.device) -> FreshBatch | None:
    fresh = [s for s in seqs if s.num_new_tokens > 1 and s.num_past_tokens == 0]
    if len(fresh) < MIN_FRESH_PROMPTS:
        return None
    max_len = max(s.num_new_tokens for s in fresh)
    gather, valid, dest = [], [], []
    for row, s in enumerate(fresh):
        n = s.num_new_tokens
        gather.extend(range(s.start, s.start + n))
        gather.extend([s.start] * (max_len - n))  # any real row: its output is dropped
        valid.extend(range(row * max_len, row * max_len + n))
        dest.extend(range(s.start, s.start + n))

    def as_index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device)

    return FreshBatch(len(fresh), max_len, as_index(gather), as_index(valid), as_index(dest),
                      frozenset(s.start for s in fresh))


def fresh_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: FreshBatch, scale: float,
                  out: torch.Tensor) -> None:
    """out[fresh tokens] = causal attention of each fresh prompt over its own new K/V."""
    shape_q = (batch.num_prompts, batch.max_len, q.shape[1], q.shape[2])
    shape_kv = (batch.num_prompts, batch.max_len, k.shape[1], k.shape[2])
    qp = q.index_select(0, batch.gather_idx).view(shape_q).transpose(1, 2)  # [P, heads, L, head_dim]
    kp = k.index_select(0, batch.gather_idx).view(shape_kv).transpose(1, 2)
    vp = v.index_select(0, batch.gather_idx).view(shape_kv).transpose(1, 2)
    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    flat = op.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
    out.index_copy_(0, batch.dest_idx, flat.index_select(0, batch.valid_idx))
