"""KV cache tensors (their sizing from a memory budget: engine/memory.py).

Layout per layer: K and V each `[num_blocks * block_size, num_kv_heads, head_dim]`, so a token's
slot is `block_id * block_size + offset` and one `index_copy_` writes a whole step. An int8 cache
(engine/kv/quant.py) adds per layer K and V scales `[num_slots, num_kv_heads]` in bfloat16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchgen.engine.kv import quant as kv_quant

log = logging.getLogger(__name__)

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
