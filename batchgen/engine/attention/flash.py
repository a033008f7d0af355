"""flash-attn's paged varlen on CUDA: every scheduled sequence, prefill and decode, in one kernel
launch per layer. Its pages must hold a multiple of 256 tokens.

Decode steps captured as CUDA graphs (engine/model/cuda_graphs.py) use `flash_attn_with_kvcache`
instead: its launch depends only on the batch size and the static block table / cache_seqlens
buffers, not on a host-side max_seqlen_k that would be baked into the graph.

Both calls take the layer's sliding window as `window_size=(window - 1, 0)` (flash-attn counts the
keys left of the query, transformers the keys including it) and softcapping as `softcap`;
flash-attn 2 has no attention sinks, so a model with them runs on another backend."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from batchgen.engine.attention.base import LayerKV
from batchgen.engine.packed_seq import PackedSeq, cdiv
from batchgen.engine.score_rules import NO_RULES, ScoreRules

FLASH_BLOCK_SIZE_MULTIPLE = 256  # flash-attn 2 paged KV needs pages of a multiple of 256 tokens


@dataclass(slots=True)
class FlashMetadata:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, query tokens per sequence, cumulated
    cu_seqlens_k: torch.Tensor  # [B + 1] int32, context (cached + new) per sequence, cumulated
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [B, max_num_blocks] int32


@dataclass(slots=True)
class FlashDecodeMetadata:
    """A graph-captured decode step: views of the graphs' static buffers."""

    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32
    cache_seqlens: torch.Tensor  # [B] int32, context (cached + the new token) per sequence


def flash_attn_with_kvcache():
    """flash-attn's decode-with-paged-cache function, imported on first use (tests may replace this hook)."""
    from flash_attn import flash_attn_with_kvcache as fn

    return fn


def flash_attn_varlen_func():
    """flash-attn's varlen function, imported on first use (tests may replace this hook)."""
    from flash_attn import flash_attn_varlen_func as fn

    return fn


class FlashBackend:
    name = "flash"
    describe = "flash-attn"
    default_block_size = FLASH_BLOCK_SIZE_MULTIPLE
    block_size_multiple = FLASH_BLOCK_SIZE_MULTIPLE
    reads_int8_pages = False
    supports_cuda_graphs = True
    score_rules = frozenset({"sliding_window", "softcap"})

    @staticmethod
    def requirement(device: torch.device, dtype: torch.dtype | None = None) -> str:
        return "the flash attention backend needs CUDA and the flash-attn package"

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype | None = None) -> bool:
        if device.type != "cuda":
            return False
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return False
        return True

    def build_metadata(self, seqs: list[PackedSeq], block_size: int, device: torch.device) -> FlashMetadata:
        seqlens_q = [s.num_new_tokens for s in seqs]
        seqlens_k = [s.context_len for s in seqs]
        max_num_blocks = cdiv(max(seqlens_k), block_size)
        block_table = []
        for s in seqs:
            row = s.block_table[:max_num_blocks]
            block_table.append(row + [0] * (max_num_blocks - len(row)))
        cu_q = torch.tensor([0, *itertools.accumulate(seqlens_q)], dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(seqlens_k)], dtype=torch.int32)
        return FlashMetadata(cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
                             max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
                             block_table=torch.tensor(block_table, dtype=torch.int32).to(device))

    @staticmethod
    def graph_decode_metadata(block_table: torch.Tensor, context_lens: torch.Tensor) -> FlashDecodeMetadata:
        return FlashDecodeMetadata(block_table=block_table, cache_seqlens=context_lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerKV,
                metadata: FlashMetadata | FlashDecodeMetadata, scale: float,
                rules: ScoreRules = NO_RULES) -> torch.Tensor:
        assert rules.sinks is None, "flash-attn 2 has no attention sinks (engine_config.resolve_attention)"
        extra = flash_rule_kwargs(rules)
        if isinstance(metadata, FlashDecodeMetadata):  # one query token per row; the new K/V are in the cache
            k_blocks, v_blocks = layer.blocks()
            out = flash_attn_with_kvcache()(q.contiguous().unsqueeze(1), k_blocks, v_blocks,
                                            cache_seqlens=metadata.cache_seqlens, block_table=metadata.block_table,
                                            softmax_scale=scale, causal=True, **extra)
            return out.squeeze(1)  # [B, num_heads, head_dim]
        # flash-attn aligns causal masks bottom-right when seqlen_q < seqlen_k (>= 2.1), which is
        # exactly "query i of a chunk sees the cached past plus new tokens up to itself".
        k_blocks, v_blocks = layer.blocks()
        return flash_attn_varlen_func()(
            q.contiguous(), k_blocks, v_blocks, metadata.cu_seqlens_q, metadata.cu_seqlens_k, metadata.max_seqlen_q,
            metadata.max_seqlen_k, softmax_scale=scale, causal=True, block_table=metadata.block_table, **extra)


def flash_rule_kwargs(rules: ScoreRules) -> dict:
    """flash-attn's arguments for a layer's window and softcap; none for a plain layer (any flash-attn 2)."""
    kwargs: dict = {}
    if rules.sliding_window is not None:
        # flash-attn's left window counts the keys before the query; transformers' window includes it
        kwargs["window_size"] = (rules.sliding_window - 1, 0)
    if rules.softcap is not None:
        kwargs["softcap"] = rules.softcap
    return kwargs
