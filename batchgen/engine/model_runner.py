"""The only place where scheduled sequences become tensors: pack, run the model, sample.

One step is one forward over all scheduled tokens packed into a single row:

    input_ids     [1, T]  the new tokens of every scheduled sequence, back to back
    position_ids  [1, T]  absolute positions within each sequence (RoPE needs them)
    slot_mapping  [T]     where each new token's K/V goes in the paged cache
    logits_to_keep [S]    the last token of each sequence that samples this step, so the LM head
                          runs on S rows instead of T
"""

from __future__ import annotations

import logging
import os
import time

import torch

from batchgen.engine.attention import AttentionMetadata, forward_context
from batchgen.engine.backends import AttentionBackend, PackedSeq
from batchgen.engine.kv_cache import KVCache
from batchgen.engine.sampling import Sampler
from batchgen.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 backend: AttentionBackend, compile: bool = False):
        self.model = model
        self._forward = compile_forward(model) if compile else _forward
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.backend = backend
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int]:
        """Run one step; return the sampled token of each sampler, in `out.samplers` order."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_idx: list[int] = []
        packed: list[PackedSeq] = []
        t = 0
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            context_len = start + n
            block_table = seq.block_table
            input_ids.extend(seq.token_ids[start:context_len])
            positions.extend(range(start, context_len))
            slot_mapping.extend(block_table[p // bs] * bs + p % bs for p in range(start, context_len))
            packed.append(PackedSeq(t, n, start, block_table))
            if s.samples:
                logits_idx.append(t + n - 1)
            t += n

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(dev, non_blocking=True),
            kv_caches=self.kv_cache.layers,
            block_size=bs,
            backend=self.backend,
            step=self.backend.build_metadata(packed, bs, dev),
            kv_scales=self.kv_cache.scales,
        )
        ids = torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
        keep = torch.tensor(logits_idx, dtype=torch.long).to(dev, non_blocking=True)
        with forward_context(meta):
            logits = self._forward(self.model, ids[None], pos[None], keep)[0]  # [S, vocab_size]
        return self.sampler.sample(logits, out.samplers)

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
