"""What every attention backend sees: the step's packed sequences and one layer's paged cache.

A backend is a small object chosen once per engine (registry.make_backend):
`build_metadata` turns the step's packed sequences into the tensors its kernels need, once per
step; `forward` attends for one layer, after the new K/V were written into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from batchgen.engine.packed_seq import PackedSeq
from batchgen.engine.score_rules import NO_RULES, ScoreRules


@dataclass(slots=True)
class LayerKV:
    """One layer's paged cache, after this step's new K/V were written."""

    k_cache: torch.Tensor  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_size: int
    k_scale: torch.Tensor | None = None  # int8 pages: [num_slots, kv_heads] bf16 scales
    v_scale: torch.Tensor | None = None

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches seen as pages: [num_blocks, block_size, kv_heads, head_dim] (flash-attn's layout)."""
        shape = (-1, self.block_size, *self.k_cache.shape[1:])
        return self.k_cache.view(shape), self.v_cache.view(shape)


DEFAULT_BLOCK_SIZE = 16  # tokens per page where a kernel has no size of its own: little waste in a short last page


class AttentionBackend(Protocol):
    """A backend class also states its rules as class attributes (registry.py reads them):
    `default_block_size`, `block_size_multiple`, `reads_int8_pages`, `supports_cuda_graphs`,
    `score_rules` (which ScoreRules fields it honours), and `available(device, dtype)` /
    `requirement(device, dtype)` (the error where it is not)."""

    name: str

    def build_metadata(self, seqs: list[PackedSeq], block_size: int, device: torch.device) -> Any:
        """Per-step tensors for `forward`, built once and shared by every layer."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, metadata: Any,
                scale: float, rules: ScoreRules = NO_RULES) -> torch.Tensor:
        """q [T, heads, head_dim], the step's new k/v [T, kv_heads, head_dim] -> out [T, heads, head_dim];
        scores are q . k * scale, then `rules` (the layer's window, softcap, sinks).
        With int8 pages k/v are the model's values, not quantized: a path attending over them rather
        than the pages must see them as the pages hold them (kv_quant.fake_quantize)."""
