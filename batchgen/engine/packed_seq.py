"""A scheduled sequence's place in a step's packed row of tokens, as attention sees it: what the
attention backends and the C attention kernels' bindings both read, so it lives below both."""

from __future__ import annotations

from dataclasses import dataclass

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
