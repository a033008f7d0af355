"""Attention with scores spelled out, for the score rules torch's SDPA has no argument for:
attention logit softcapping (Gemma 2) and attention sinks (gpt-oss). It computes what
transformers' eager attention for those models computes, in float32 throughout."""

from __future__ import annotations

import torch

from batchgen.engine.score_rules import ScoreRules


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, rules: ScoreRules, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, heads, M, D], k/v [B, heads, L, D] (as many heads as q: the caller lays GQA out),
    mask bool, broadcastable to [B, heads, M, L], True where a key is seen (None: all are);
    sinks broadcastable to [heads, M, 1] (the caller's view of rules.sinks) -> out [B, heads, M, D]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, heads, M, L]
    if rules.softcap is not None:
        scores = torch.tanh(scores / rules.softcap) * rules.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit per row, in the denominator only
        scores = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
