"""The portable backend: torch's SDPA over K/V gathered from the pages (CPU and CUDA).

Decode sequences (one query token) are grouped by context length and each group runs one batched
SDPA, padded to its longest context and masked; prefill chunks run one causal SDPA each, with the
query offset by the tokens already cached. The CPU backend reuses the prefill half.

A layer's sliding window narrows the same masks (built per window, once a step, at the first layer
that needs it); softcapping and sinks, which SDPA has no argument for, go through
explicit_attention with the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.engine.attention.base import DEFAULT_BLOCK_SIZE, LayerKV
from batchgen.engine.attention.explicit import explicit_attention
from batchgen.engine.attention.padded_prefill import PaddedBatch, build_padded_batches, padded_forward
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.packed_seq import PackedSeq, cdiv
from batchgen.engine.score_rules import NO_RULES, ScoreRules

# decode sequences are grouped by context length so that padding to a group's longest context
# wastes little; a new group starts when the longest would exceed this multiple of the shortest
DECODE_GROUP_MAX_RATIO = 2.0
# On a GPU one group: each group costs a few launches per layer from Python, which the padding it
# saves does not repay, and every new group shape makes cuDNN's attention build another plan.
ACCELERATOR_DECODE_GROUP_MAX_RATIO = float("inf")


@dataclass(slots=True)
class DecodeGroup:
    """Sequences that each have exactly one query token this step."""

    token_idx: torch.Tensor  # [B] positions of their query tokens in the packed row
    block_ids: torch.Tensor  # [B * max_num_blocks] each one's block table, padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_num_blocks * block_size] True where the key is real
    max_num_blocks: int
    context_lens: torch.Tensor  # [B] on the host
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """`mask`, narrowed to the last `sliding_window` keys of each sequence (its query's window)."""
        if sliding_window is None:
            return self.mask
        if sliding_window not in self._windowed:
            key_pos = torch.arange(self.mask.shape[-1])[None, :]
            seen = key_pos >= (self.context_lens[:, None] - sliding_window)
            self._windowed[sliding_window] = self.mask & seen[:, None, None, :].to(self.mask.device)
        return self._windowed[sliding_window]


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with several query tokens this step (a prompt or a chunk of one)."""

    start: int  # its first query token in the packed row
    end: int
    context_len: int  # cached past + new tokens
    # its block table covering [0, context_len), or None when it has no cached past, so its
    # new K/V are the whole context and need no gather
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None  # [num_new, context_len] causal with offset; None = plain causal
    device: torch.device | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, sliding_window: int | None, explicit: bool) -> torch.Tensor | None:
        """The mask of a layer with this window ([num_new, context_len], True where seen); None for
        plain causal attention where SDPA's is_causal does it (no window, no explicit scores)."""
        if sliding_window is None and (self.mask is not None or not explicit):
            return self.mask
        key = sliding_window or 0
        if key not in self._masks:
            num_new = self.end - self.start
            q_pos = torch.arange(self.context_len - num_new, self.context_len)[:, None]
            k_pos = torch.arange(self.context_len)[None, :]
            seen = k_pos <= q_pos
            if sliding_window is not None:
                seen &= k_pos > q_pos - sliding_window  # transformers' sliding_window_overlay
            self._masks[key] = seen.to(self.device)
        return self._masks[key]


@dataclass(slots=True)
class SdpaMetadata:
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
    # multi-token sequences in one padded call per kind where a layer's scores are plain
    # (padded_prefill.py), and the prefills neither batch holds
    fresh: PaddedBatch | None = None
    with_past: PaddedBatch | None = None
    unpadded: list[PrefillSeq] = field(default_factory=list)
    fresh_unpadded: list[PrefillSeq] = field(default_factory=list)  # with the fresh prompts, for int8 pages


def build_prefills(seqs: list[PackedSeq], block_size: int, device: torch.device) -> list[PrefillSeq]:
    out = []
    for s in seqs:
        if s.num_new_tokens == 1:
            continue
        end = s.start + s.num_new_tokens
        if s.num_past_tokens == 0:
            # no cached past: the new K/V are the whole context, plain causal attention
            out.append(PrefillSeq(s.start, end, s.context_len, None, None, device))
            continue
        q_pos = torch.arange(s.num_past_tokens, s.context_len)
        mask = torch.arange(s.context_len)[None, :] <= q_pos[:, None]  # [num_new, context_len]
        block_ids = torch.tensor(s.block_table[:cdiv(s.context_len, block_size)])
        out.append(PrefillSeq(s.start, end, s.context_len, block_ids.to(device), mask.to(device), device))
    return out


def prefill_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerKV,
                    prefills: list[PrefillSeq], scale: float, out: torch.Tensor, rules: ScoreRules = NO_RULES) -> None:
    k_blocks, v_blocks = layer.blocks()
    explicit = rules.softcap is not None or rules.sinks is not None
    for p in prefills:
        qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
        if p.block_ids is None:  # the new K/V as the pages hold them (int8 pages: quantized on write)
            kp = k[p.start:p.end] if layer.k_scale is None else kv_quant.fake_quantize(k[p.start:p.end])
            vp = v[p.start:p.end] if layer.v_scale is None else kv_quant.fake_quantize(v[p.start:p.end])
        else:  # [context_len, kv_heads, head_dim]
            kp = kv_quant.gather(k_blocks, layer.k_scale, p.block_ids, q.dtype).flatten(0, 1)[: p.context_len]
            vp = kv_quant.gather(v_blocks, layer.v_scale, p.block_ids, q.dtype).flatten(0, 1)[: p.context_len]
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context_len, head_dim]
        vp = vp.transpose(0, 1).unsqueeze(0)
        mask = p.mask_for(rules.sliding_window, explicit)
        if explicit:
            group_size = qp.shape[1] // kp.shape[1]  # head h reads KV head h // group_size (repeat_kv's order)
            op = explicit_attention(qp, kp.repeat_interleave(group_size, 1), vp.repeat_interleave(group_size, 1),
                                    mask, scale, rules, None if rules.sinks is None else rules.sinks.view(-1, 1, 1))
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                                scale=scale, enable_gqa=True)
        out[p.start:p.end] = op[0].transpose(0, 1)


class SdpaBackend:
    name = "sdpa"
    describe = "torch SDPA"
    default_block_size = DEFAULT_BLOCK_SIZE
    block_size_multiple = 1
    reads_int8_pages = True
    supports_cuda_graphs = False

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return True  # torch's own op, on every device and dtype

    @staticmethod
    def requirement(device: torch.device, dtype: torch.dtype) -> str:
        raise AssertionError("SDPA is always available")

    def build_metadata(self, seqs: list[PackedSeq], block_size: int, device: torch.device) -> SdpaMetadata:
        decode = sorted((s for s in seqs if s.num_new_tokens == 1), key=lambda s: s.context_len)
        max_ratio = DECODE_GROUP_MAX_RATIO if device.type == "cpu" else ACCELERATOR_DECODE_GROUP_MAX_RATIO
        groups: list[list[PackedSeq]] = []
        for s in decode:
            if not groups or s.context_len > max_ratio * groups[-1][0].context_len:
                groups.append([])
            groups[-1].append(s)
        prefills = build_prefills(seqs, block_size, device)
        fresh, with_past = build_padded_batches(seqs, block_size, device)
        padded = (fresh.starts if fresh else frozenset()) | (with_past.starts if with_past else frozenset())
        unpadded = [p for p in prefills if p.start not in padded]
        fresh_unpadded = [p for p in prefills if with_past is None or p.start not in with_past.starts]
        return SdpaMetadata([_decode_group(g, block_size, device) for g in groups], prefills, fresh, with_past,
                            unpadded, fresh_unpadded)

    score_rules = frozenset({"sliding_window", "softcap", "sinks"})

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, metadata: SdpaMetadata,
                scale: float, rules: ScoreRules = NO_RULES) -> torch.Tensor:
        # NOTE: torch.empty_like(q) would copy q's transposed strides; the output must be dense
        out = q.new_empty(q.shape)  # [T, num_heads, head_dim]
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group_size = num_heads // num_kv_heads
        k_blocks, v_blocks = layer.blocks()
        for group in metadata.decode_groups:
            batch = group.token_idx.shape[0]
            shape = (batch, group.max_num_blocks * layer.block_size, num_kv_heads, head_dim)
            kd = kv_quant.gather(k_blocks, layer.k_scale, group.block_ids, q.dtype).view(shape).transpose(1, 2)
            vd = kv_quant.gather(v_blocks, layer.v_scale, group.block_ids, q.dtype).view(shape).transpose(1, 2)
            # One query token per sequence: the query heads sharing a KV head become that head's
            # "query positions" ([B, kv_heads, group_size, head_dim]), so GQA needs no repeated K/V.
            # Head h reads KV head h // group_size, as transformers' repeat_kv lays them out.
            qd = q.index_select(0, group.token_idx).view(batch, num_kv_heads, group_size, head_dim)
            mask = group.mask_for(rules.sliding_window)
            if rules.softcap is not None or rules.sinks is not None:
                sinks = None if rules.sinks is None else rules.sinks.view(num_kv_heads, group_size, 1)
                od = explicit_attention(qd, kd, vd, mask, scale, rules, sinks)
            else:
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            out.index_copy_(0, group.token_idx, od.reshape(batch, num_heads, head_dim))
        if rules.sliding_window is not None or rules.softcap is not None or rules.sinks is not None:
            prefill_forward(q, k, v, layer, metadata.prefills, scale, out, rules)
            return out
        if metadata.with_past is not None:
            padded_forward(q, k, v, layer, metadata.with_past, scale, out)
        if metadata.fresh is not None and layer.k_scale is None:
            padded_forward(q, k, v, layer, metadata.fresh, scale, out)
            prefill_forward(q, k, v, layer, metadata.unpadded, scale, out, rules)
        else:
            prefill_forward(q, k, v, layer, metadata.fresh_unpadded, scale, out, rules)
        return out


def _decode_group(group: list[PackedSeq], block_size: int, device: torch.device) -> DecodeGroup:
    max_num_blocks = cdiv(group[-1].context_len, block_size)
    block_ids: list[int] = []
    for s in group:
        n = cdiv(s.context_len, block_size)
        block_ids.extend(s.block_table[:n])
        block_ids.extend([0] * (max_num_blocks - n))  # padding block 0, masked below
    context_lens = torch.tensor([s.context_len for s in group])
    mask = torch.arange(max_num_blocks * block_size)[None, :] < context_lens[:, None]
    return DecodeGroup(
        token_idx=torch.tensor([s.start for s in group]).to(device),
        block_ids=torch.tensor(block_ids).to(device),
        mask=mask[:, None, None, :].to(device),
        max_num_blocks=max_num_blocks,
        context_lens=context_lens,
    )
