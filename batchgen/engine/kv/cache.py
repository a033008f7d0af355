"""KV cache tensors and their sizing from a memory budget.

Layout per layer: K and V each `[num_blocks * block_size, num_kv_heads, head_dim]`, so a token's
slot is `block_id * block_size + offset` and one `index_copy_` writes a whole step. An int8 cache
(engine/kv/quant.py) adds per layer K and V scales `[num_slots, num_kv_heads]` in bfloat16.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from batchgen.engine.attention.paged import ATTN_IMPLEMENTATION
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.model.load_attention import load_attention

log = logging.getLogger(__name__)

# the CPU default when no budget is given: a fraction of the memory the OS reports available,
# capped so a shared machine keeps room for the model, the activations and the reader
CPU_KV_FRACTION = 0.25
CPU_KV_CAP_BYTES = 2 * 2**30
CUDA_MEMORY_UTILIZATION = 0.90


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the pages hold: the model dtype, or torch.int8 (with scales)
    block_size: int

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
        config = getattr(config, "text_config", None) or config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype, block_size)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_head = self.head_dim * elem + kv_quant.scale_bytes_per_head(self.dtype)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def available_cpu_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_num_blocks(spec: KVCacheSpec, device: torch.device, budget_bytes: int | None,
                    activation_peak_bytes: int = 0) -> int:
    """How many blocks fit: an explicit budget, else a share of free memory on the device."""
    if budget_bytes is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            budget_bytes = int(total * CUDA_MEMORY_UTILIZATION) - used - activation_peak_bytes
        else:
            budget_bytes = min(int(available_cpu_bytes() * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no block of "
                         f"{spec.bytes_per_block} bytes")
    return int(num_blocks)


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                 layer_tensors: tuple[int, ...] | None = None):
        """`spec.num_layers` K/V tensor pairs; with `layer_tensors` (kv/groups.py: layers of several
        groups share a pair) `layers[i]` is pair `layer_tensors[i]`, else pair i."""
        self.spec = spec
        self.num_blocks = num_blocks
        num_slots = num_blocks * spec.block_size
        shape = (num_slots, spec.num_kv_heads, spec.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=spec.dtype, device=device),
             torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)
        ]
        # int8 pages: per layer (k_scale, v_scale), each [num_slots, num_kv_heads]; None otherwise
        self.scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if spec.dtype == torch.int8:
            scale_shape = (num_slots, spec.num_kv_heads)
            self.scales = [(torch.zeros(scale_shape, dtype=kv_quant.SCALE_DTYPE, device=device),
                            torch.zeros(scale_shape, dtype=kv_quant.SCALE_DTYPE, device=device))
                           for _ in range(spec.num_layers)]
        if layer_tensors is not None:
            self.layers = [self.layers[j] for j in layer_tensors]
            if self.scales is not None:
                self.scales = [self.scales[j] for j in layer_tensors]
        log.debug("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB", num_blocks, spec.block_size,
                  num_slots, num_blocks * spec.bytes_per_block / 2**20)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block


def profile_activation_bytes(model, num_tokens: int, num_seqs: int) -> int:
    """Peak activation memory of one full-budget step, so the KV cache leaves room for it.

    Runs the model once on `num_tokens` dummy tokens with plain SDPA attention (whose memory is
    close to ours) and `num_seqs` logits rows, then restores our attention function. A class that
    refuses SDPA (Gemma 2, gpt-oss) runs eager, whose score matrix over-counts: a smaller cache,
    never an out-of-memory step.
    """
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model.set_attn_implementation(load_attention(model.config) or "sdpa")
    try:
        with torch.inference_mode():
            ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
            keep = torch.arange(num_tokens - min(num_seqs, num_tokens), num_tokens, device=device)
            model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        torch.cuda.synchronize(device)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)
