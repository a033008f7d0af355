"""The only place where scheduled sequences become tensors: pack, run the model, sample.

One step is one forward over all scheduled tokens packed into a single row:

    input_ids     [1, T]  the new tokens of every scheduled sequence, back to back
    position_ids  [1, T]  absolute positions within each sequence (RoPE needs them)
    slot_mapping  [T]     where each new token's K/V goes in the paged cache
    logits_to_keep [S]    the last token of each sequence that samples this step, so the LM head
                          runs on S rows instead of T
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from batchgen.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    FlashMetadata,
    NativeDecode,
    PrefillSeq,
    forward_context,
)
from batchgen.engine.kv_cache import KVCache
from batchgen.engine.sampling import Sampler
from batchgen.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# decode sequences are grouped by context length so that padding to a group's longest context
# wastes little; a new group starts when the longest would exceed this multiple of the shortest
DECODE_GROUP_MAX_RATIO = 2.0


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 backend: str = "torch", compile: bool = False, eos_token_ids: list[int] | None = None):
        assert backend in ("torch", "cpu", "flash")
        self.model = model
        self._forward = compile_forward(model) if compile else _forward
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.backend = backend
        self.sampler = Sampler(eos_token_ids)  # EOS ids: what min_tokens masks

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int]:
        """Run one step; return the sampled token of each sampler, in `out.samplers` order."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_idx: list[int] = []
        decode: list[tuple[int, list[int], int]] = []  # (token index, block_table, context_len)
        prefills: list[PrefillSeq] = []
        t = 0
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            context_len = start + n
            block_table = seq.block_table
            input_ids.extend(seq.token_ids[start:context_len])
            positions.extend(range(start, context_len))
            slot_mapping.extend(block_table[p // bs] * bs + p % bs for p in range(start, context_len))
            if n == 1:
                decode.append((t, block_table, context_len))
            else:
                prefills.append(self._prefill_seq(t, n, start, block_table))
            if s.samples:
                logits_idx.append(t + n - 1)
            t += n

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(dev, non_blocking=True),
            kv_caches=self.kv_cache.layers,
            block_size=bs,
            kv_scales=self.kv_cache.scales,
        )
        if self.backend == "flash":
            meta.flash = self._flash_metadata(out)
        elif self.backend == "cpu":
            meta.native_decode = self._native_decode(decode)
            meta.prefills = prefills
        else:
            meta.decode_groups = self._decode_groups(decode)
            meta.prefills = prefills
        ids = torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
        keep = torch.tensor(logits_idx, dtype=torch.long).to(dev, non_blocking=True)
        with forward_context(meta):
            logits = self._forward(self.model, ids[None], pos[None], keep)[0]  # [S, vocab_size]
        return self.sampler.sample(logits, out.samplers)

    def _flash_metadata(self, out: SchedulerOutput) -> FlashMetadata:
        seqlens_q = [s.num_new_tokens for s in out.scheduled]
        seqlens_k = [s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled]
        max_num_blocks = -(-max(seqlens_k) // self.block_size)
        block_table = []
        for s in out.scheduled:
            row = s.seq.block_table[:max_num_blocks]
            block_table.append(row + [0] * (max_num_blocks - len(row)))
        cu_q = torch.tensor([0, *itertools.accumulate(seqlens_q)], dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(seqlens_k)], dtype=torch.int32)
        dev = self.device
        return FlashMetadata(cu_seqlens_q=cu_q.to(dev), cu_seqlens_k=cu_k.to(dev), max_seqlen_q=max(seqlens_q),
                             max_seqlen_k=max(seqlens_k),
                             block_table=torch.tensor(block_table, dtype=torch.int32).to(dev))

    def _prefill_seq(self, start_token: int, num_new: int, num_past: int,
                     block_table: list[int]) -> PrefillSeq:
        context_len = num_past + num_new
        if num_past == 0:
            # no cached past: the new K/V are the whole context, plain causal attention
            return PrefillSeq(start_token, start_token + num_new, context_len, None, None)
        num_blocks = -(-context_len // self.block_size)
        q_pos = torch.arange(num_past, context_len)
        mask = torch.arange(context_len)[None, :] <= q_pos[:, None]  # [num_new, context_len]
        return PrefillSeq(start_token, start_token + num_new, context_len,
                          torch.tensor(block_table[:num_blocks]).to(self.device), mask.to(self.device))

    def _native_decode(self, decode: list[tuple[int, list[int], int]]) -> NativeDecode | None:
        if not decode:
            return None
        max_num_blocks = max(-(-c // self.block_size) for _, _, c in decode)
        block_tables = [bt[:max_num_blocks] + [0] * (max_num_blocks - len(bt[:max_num_blocks])) for _, bt, _ in decode]
        dev = self.device
        return NativeDecode(
            token_idx=torch.tensor([i for i, _, _ in decode]).to(dev),
            block_tables=torch.tensor(block_tables, dtype=torch.int32).to(dev),
            context_lens=torch.tensor([c for _, _, c in decode], dtype=torch.int32).to(dev),
        )

    def _decode_groups(self, decode: list[tuple[int, list[int], int]]) -> list[DecodeGroup]:
        if not decode:
            return []
        decode = sorted(decode, key=lambda d: d[2])
        groups, current = [], [decode[0]]
        for d in decode[1:]:
            if d[2] > DECODE_GROUP_MAX_RATIO * current[0][2]:
                groups.append(current)
                current = []
            current.append(d)
        groups.append(current)
        return [self._decode_group(g) for g in groups]

    def _decode_group(self, group: list[tuple[int, list[int], int]]) -> DecodeGroup:
        max_num_blocks = -(-group[-1][2] // self.block_size)
        block_ids: list[int] = []
        for _, block_table, context_len in group:
            n = -(-context_len // self.block_size)
            block_ids.extend(block_table[:n])
            block_ids.extend([0] * (max_num_blocks - n))  # padding block 0, masked below
        context_lens = torch.tensor([c for _, _, c in group])
        mask = torch.arange(max_num_blocks * self.block_size)[None, :] < context_lens[:, None]
        dev = self.device
        return DecodeGroup(
            token_idx=torch.tensor([i for i, _, _ in group]).to(dev),
            block_ids=torch.tensor(block_ids).to(dev),
            mask=mask[:, None, None, :].to(dev),
            max_num_blocks=max_num_blocks,
        )

    def add(self, seq) -> None:
        self.sampler.add(seq)

    def release(self, seq) -> None:
        self.sampler.release(seq)


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
             logits_to_keep: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                 logits_to_keep=logits_to_keep).logits


def compile_forward(model: torch.nn.Module):
    """The forward through torch.compile (inductor), dynamic in the number of packed tokens.

    Attention is the opaque `batchgen::paged_attention` op, so the whole model is one graph and
    the pointwise chains between the linear layers (RMSNorm, RoPE, SiLU * up, residual adds) fuse.
    Compiled kernels are cached on disk (TORCHINDUCTOR_CACHE_DIR, default: batchgen's cache), so
    only the first run on a machine pays the full compile; each later process still traces.
    """
    from batchgen.engine.loader import cache_root

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    compiled = torch.compile(_forward, dynamic=True)
    first = True

    def forward(*args):
        nonlocal first
        if not first:
            return compiled(*args)
        t0 = time.perf_counter()
        out = compiled(*args)
        first = False
        log.info("compiled forward ready in %.1f s (traced, compiled or loaded from %s)", time.perf_counter() - t0,
                 os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return out

    return forward
