"""A step's multi-token sequences attended in one padded SDPA call per kind, not one call each.

On a GPU without flash-attn every SDPA call is a few kernel launches driven from Python, and a
prefill step of a continuous batch holds dozens of prompts, chunk continuations, prefix-cache
followers and rows with jump-forward drafts: one call per sequence and layer makes the step
CPU-bound while the device waits (and each new length made cuDNN build another plan).

- Fresh prompts (no cached past) need no page gather: their new K/V are the whole context.
  Right-padded to the longest and run with is_causal, every real query sees only keys at or before
  its own position, all real, so no mask is needed and each row's result is the one a call of its
  own gives (the padded positions add exact zeros to the softmax sums).
- Sequences with a cached past read their whole context from the pages (padded to the longest,
  block 0 as filler), with one mask [seqs, 1, max_new, max_context]: query i of a sequence with
  `past` cached tokens sees keys 0 .. past + i. Padded query rows see key 0 only (no empty row,
  whose softmax would be NaN); their outputs are dropped.

Only layers with plain scores take these paths (no sliding window, softcap or sinks): those keep
the per-sequence calls, which build their own masks. Fresh prompts over int8 pages keep them too
(their K/V must be the pages' rounding, which the gather of the with-past path gives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.engine.attention.base import LayerKV
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.packed_seq import PackedSeq, cdiv

# below this many sequences of a kind in a step the per-sequence calls are as cheap
MIN_PADDED_SEQS = 2


@dataclass(slots=True)
class PaddedBatch:
    num_seqs: int
    max_new: int  # the most new tokens of one sequence: the padded query length
    gather_idx: torch.Tensor  # [num_seqs * max_new] packed-row index per padded slot (padding: its seq's first)
    valid_idx: torch.Tensor  # [num_real] padded slots holding a real token, in the order of dest_idx
    dest_idx: torch.Tensor  # [num_real] their packed-row positions
    starts: frozenset[int]  # the sequences' first packed positions (the per-sequence path skips them)
    # with a cached past: each sequence's block table padded with block 0, and the mask
    block_ids: torch.Tensor | None = None  # [num_seqs * max_num_blocks]
    max_num_blocks: int = 0
    mask: torch.Tensor | None = None  # [num_seqs, 1, max_new, max_num_blocks * block_size], True = seen


def build_padded_batches(seqs: list[PackedSeq], block_size: int,
                         device: torch.device) -> tuple[PaddedBatch | None, PaddedBatch | None]:
    """(fresh prompts, sequences with a cached past), each None below MIN_PADDED_SEQS."""
    multi = [s for s in seqs if s.num_new_tokens > 1]
    fresh = [s for s in multi if s.num_past_tokens == 0]
    past = [s for s in multi if s.num_past_tokens > 0]
    return (_batch(fresh, block_size, device, with_past=False) if len(fresh) >= MIN_PADDED_SEQS else None,
            _batch(past, block_size, device, with_past=True) if len(past) >= MIN_PADDED_SEQS else None)


def _batch(seqs: list[PackedSeq], block_size: int, device: torch.device, *, with_past: bool) -> PaddedBatch:
    max_new = max(s.num_new_tokens for s in seqs)
    gather, valid, dest = [], [], []
    for row, s in enumerate(seqs):
        n = s.num_new_tokens
        gather.extend(range(s.start, s.start + n))
        gather.extend([s.start] * (max_new - n))  # any real row: its output is dropped
        valid.extend(range(row * max_new, row * max_new + n))
        dest.extend(range(s.start, s.start + n))
    batch = PaddedBatch(len(seqs), max_new, _index(gather, device), _index(valid, device), _index(dest, device),
                        frozenset(s.start for s in seqs))
    if with_past:
        max_num_blocks = max(cdiv(s.context_len, block_size) for s in seqs)
        block_ids: list[int] = []
        for s in seqs:
            n = cdiv(s.context_len, block_size)
            block_ids.extend(s.block_table[:n])
            block_ids.extend([0] * (max_num_blocks - n))  # filler pages, masked below
        past = torch.tensor([s.num_past_tokens for s in seqs])[:, None, None]
        num_new = torch.tensor([s.num_new_tokens for s in seqs])[:, None, None]
        q_pos = torch.arange(max_new)[None, :, None]
        k_pos = torch.arange(max_num_blocks * block_size)[None, None, :]
        mask = (k_pos <= past + q_pos) & (q_pos < num_new) | (k_pos == 0)
        batch.block_ids = _index(block_ids, device)
        batch.max_num_blocks = max_num_blocks
        batch.mask = mask[:, None].to(device)
    return batch


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device)


def padded_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, batch: PaddedBatch,
                   scale: float, out: torch.Tensor) -> None:
    """out[the batch's tokens] = their causal attention, fresh K/V or the pages."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    qp = q.index_select(0, batch.gather_idx).view(batch.num_seqs, batch.max_new, num_heads, head_dim).transpose(1, 2)
    if batch.block_ids is None:
        shape = (batch.num_seqs, batch.max_new, k.shape[1], k.shape[2])
        kp = k.index_select(0, batch.gather_idx).view(shape).transpose(1, 2)
        vp = v.index_select(0, batch.gather_idx).view(shape).transpose(1, 2)
    else:
        k_blocks, v_blocks = layer.blocks()
        shape = (batch.num_seqs, batch.max_num_blocks * layer.block_size, k.shape[1], k.shape[2])
        kp = kv_quant.gather(k_blocks, layer.k_scale, batch.block_ids, q.dtype).view(shape).transpose(1, 2)
        vp = kv_quant.gather(v_blocks, layer.v_scale, batch.block_ids, q.dtype).view(shape).transpose(1, 2)
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.mask, is_causal=batch.mask is None,
                                        scale=scale, enable_gqa=True)
    flat = op.transpose(1, 2).reshape(-1, num_heads, head_dim)
    out.index_copy_(0, batch.dest_idx, flat.index_select(0, batch.valid_idx))
