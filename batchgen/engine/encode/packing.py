"""A batch of token sequences laid end to end in one row, and the indices its attention needs.

A packed batch has no padding: the model's linears, norms and MLPs run on exactly the batch's real
tokens. Only attention needs to know where one sequence ends and the next begins; it reads that from
`cu_seqlens` (flash-attn's varlen kernel) or from `padded_index` / `padded_valid`, which scatter the
packed tokens into a [rows, longest] layout for one SDPA call (rows of a length-sorted batch are
close in length, so that layout wastes little).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

# Model types whose embeddings number positions from padding_idx + 1 and give pad tokens the
# position padding_idx (transformers' create_position_ids_from_input_ids)
_PADDING_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text",
                                       "roberta-prelayernorm", "xmod"})


@dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor  # long [T]: every sequence's tokens, one after another
    position_ids: torch.Tensor  # long [T]: each token's position within its own sequence (as the model numbers them)
    cu_seqlens: list[int]  # [rows + 1]: sequence i spans [cu_seqlens[i], cu_seqlens[i + 1])
    lengths: list[int]  # [rows]
    _padded: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _cu_seqlens_tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def cu_seqlens_tensor(self) -> torch.Tensor:
        """int32 [rows + 1] on the batch's device (flash-attn's varlen arguments)."""
        if self._cu_seqlens_tensor is None:
            self._cu_seqlens_tensor = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=self.device)
        return self._cu_seqlens_tensor

    def padded_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(index long [rows, max_len] into the packed tokens, valid bool [rows, max_len]); a padded slot's
        index is 0 and its valid False. `x[index][valid]` gives back the packed order."""
        if self._padded is None:
            device = self.device
            lengths = torch.tensor(self.lengths, device=device)
            starts = torch.tensor(self.cu_seqlens[:-1], device=device)
            offsets = torch.arange(self.max_len, device=device)
            valid = offsets[None, :] < lengths[:, None]
            index = torch.where(valid, starts[:, None] + offsets[None, :], torch.zeros((), dtype=torch.long,
                                                                                      device=device))
            self._padded = (index, valid)
        return self._padded

    def last_token_index(self) -> torch.Tensor:
        """long [rows]: the packed index of each sequence's last token."""
        return torch.tensor(self.cu_seqlens[1:], device=self.device) - 1

    def first_token_index(self) -> torch.Tensor:
        """long [rows]: the packed index of each sequence's first token."""
        return torch.tensor(self.cu_seqlens[:-1], device=self.device)

    def row_of_token(self) -> torch.Tensor:
        """long [T]: which sequence each packed token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_rows, device=self.device),
                                       torch.tensor(self.lengths, device=self.device))


@dataclass(frozen=True, slots=True)
class PositionRule:
    """How a model numbers its positions: from 0 per sequence, or RoBERTa's padding_idx + 1 with pad
    tokens at padding_idx."""

    padding_idx: int | None = None


def position_rule(model: PreTrainedModel) -> PositionRule:
    config = model.config.get_text_config()
    if config.model_type in _PADDING_OFFSET_POSITIONS and config.pad_token_id is not None:
        return PositionRule(padding_idx=int(config.pad_token_id))
    return PositionRule()


def pack(rows: Sequence[Sequence[int]], *, rule: PositionRule = PositionRule(),
         device: torch.device | str = "cpu") -> PackedBatch:
    """The rows (token ids, each non-empty) packed end to end."""
    assert rows and all(len(r) for r in rows), "a packed batch holds at least one row, none empty"
    lengths = [len(r) for r in rows]
    cu_seqlens = [0]
    for length in lengths:
        cu_seqlens.append(cu_seqlens[-1] + length)
    input_ids = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.long)
    starts = torch.repeat_interleave(torch.tensor(cu_seqlens[:-1]), torch.tensor(lengths))
    if rule.padding_idx is None:
        position_ids = torch.arange(cu_seqlens[-1]) - starts
    else:  # as create_position_ids_from_input_ids, per sequence
        keep = input_ids.ne(rule.padding_idx).long()
        counted = keep.cumsum(0)
        before = torch.cat([torch.zeros(1, dtype=torch.long), counted])[starts]
        position_ids = (counted - before) * keep + rule.padding_idx
    return PackedBatch(input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                       cu_seqlens=cu_seqlens, lengths=lengths)
