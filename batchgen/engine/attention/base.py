"""What every attention backend sees: the step's packed sequences and one layer's paged cache.

A backend is a small object chosen once per engine (registry.make_backend):
`build_metadata` turns the step's packed sequences into the tensors its kernels need, once per
step; `forward` attends for one layer, after the new K/V were written into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class PackedSeq:
    """One scheduled sequence's place in the step's packed row of tokens."""

    start: int  # its first new token in the packed row
    num_new_tokens: int
    num_past_tokens: int  # already in the cache before this step
    block_table: list[int]

    @property
    def context_len(self) -> int:
        return self.num_past_tokens + self.num_new_tokens


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


@dataclass(frozen=True, slots=True)
class ScoreRules:
    """How one layer turns its scaled q . k scores into probabilities, beyond causality: what
    transformers passes the attention function as `sliding_window`, `softcap` and `s_aux`."""

    sliding_window: int | None = None  # query i sees keys j with i - sliding_window < j <= i (transformers' rule)
    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap, before the mask (Gemma 2)
    sinks: torch.Tensor | None = None  # [num_heads] float32: a logit in each head's softmax denominator (gpt-oss)

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.softcap is None and self.sinks is None

    def first_key(self, query_pos: int) -> int:
        """The first key position query position `query_pos` attends."""
        return 0 if self.sliding_window is None else max(0, query_pos - self.sliding_window + 1)


NO_RULES = ScoreRules()

# what a backend class lists in `score_rules`: the ScoreRules fields it honours
SCORE_RULE_FEATURES = {"sliding_window": "sliding-window attention", "softcap": "attention logit softcapping",
                       "sinks": "attention sinks"}


def rules_used(rules: ScoreRules) -> set[str]:
    return {name for name in SCORE_RULE_FEATURES if getattr(rules, name) is not None}


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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_table_tensor(seqs: list[PackedSeq], block_size: int) -> torch.Tensor:
    """[len(seqs), max blocks] int32: each sequence's blocks covering its context, padded with
    block 0, which the C kernels never read (they stop at each context length)."""
    max_num_blocks = max(cdiv(s.context_len, block_size) for s in seqs)
    rows = []
    for s in seqs:
        row = s.block_table[:max_num_blocks]
        rows.append(row + [0] * (max_num_blocks - len(row)))
    return torch.tensor(rows, dtype=torch.int32)
