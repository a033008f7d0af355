"""What the bindings share: the dtype codes the C kernels take (csrc/common.h defines the same
numbers for the C side; tests/engine/kernels/test_common.py checks that they agree), and the
arguments both attention kernels (paged_decode.c, prefill_attention.c) take alike."""

from __future__ import annotations

import torch

from batchgen.engine.score_rules import ScoreRules

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float16: 3}
# what most kernels read (activations, logits, queries): float32 and bfloat16
FLOAT_CODES = {dtype: DTYPE_CODES[dtype] for dtype in (torch.float32, torch.bfloat16)}
# KV pages: the query's dtype, or int8 with per-token, per-head bf16 scales
KV_CODES = {dtype: DTYPE_CODES[dtype] for dtype in (torch.float32, torch.bfloat16, torch.int8)}


def rule_args(rules: ScoreRules, num_heads: int) -> dict:
    """The attention kernels' score-rule arguments: window 0 and softcap 0 mean none; sinks float32
    [num_heads] or NULL."""
    sinks = rules.sinks
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.shape == (num_heads,)
    return dict(sliding_window=rules.sliding_window or 0, softcap=float(rules.softcap or 0.0),
                sinks=None if sinks is None else sinks.data_ptr())


def int8_scale_pointers(k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
                        ) -> tuple[int | None, int | None]:
    """The K and V scales' addresses for an attention kernel reading int8 pages, each bf16
    [num_slots, kv_heads] and contiguous (engine/kv/cache.py); (None, None) for pages of another dtype."""
    if k_cache.dtype != torch.int8:
        return None, None
    assert kv_scales is not None and all(t.dtype == torch.bfloat16 and t.is_contiguous()
                                         and t.shape == k_cache.shape[:2] for t in kv_scales)
    return kv_scales[0].data_ptr(), kv_scales[1].data_ptr()
