"""The CPU default: decode through the C kernel that reads K/V in place from the pages
(engine/native.py), prefill chunks through the SDPA backend's path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine import native
from batchgen.engine.backends.base import LayerKV, PackedSeq, cdiv
from batchgen.engine.backends.sdpa import PrefillSeq, build_prefills, prefill_forward


@dataclass(slots=True)
class NativeDecode:
    """Every decode sequence of the step for the CPU kernel."""

    token_idx: torch.Tensor  # [B] positions of their query tokens in the packed row
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with block 0 (never read)
    context_lens: torch.Tensor  # [B] int32


@dataclass(slots=True)
class NativeMetadata:
    decode: NativeDecode | None
    prefills: list[PrefillSeq] = field(default_factory=list)


class NativeCpuBackend:
    name = "cpu"

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and native.PagedDecodeKernel.supports(dtype, dtype) and native.load() is not None

    def build_metadata(self, seqs: list[PackedSeq], block_size: int, device: torch.device) -> NativeMetadata:
        decode = [s for s in seqs if s.num_new_tokens == 1]
        return NativeMetadata(_native_decode(decode, block_size, device) if decode else None,
                              build_prefills(seqs, block_size, device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, metadata: NativeMetadata,
                scale: float) -> torch.Tensor:
        out = q.new_empty(q.shape)  # dense [T, num_heads, head_dim], whatever q's strides
        nd = metadata.decode
        if nd is not None:
            scales = None if layer.k_scale is None else (layer.k_scale, layer.v_scale)
            od = native.load()(q.index_select(0, nd.token_idx), layer.k_cache, layer.v_cache, nd.block_tables,
                               nd.context_lens, layer.block_size, scale, scales)
            out.index_copy_(0, nd.token_idx, od)
        prefill_forward(q, k, v, layer, metadata.prefills, scale, out)
        return out


def _native_decode(decode: list[PackedSeq], block_size: int, device: torch.device) -> NativeDecode:
    max_num_blocks = max(cdiv(s.context_len, block_size) for s in decode)
    block_tables = []
    for s in decode:
        row = s.block_table[:max_num_blocks]
        block_tables.append(row + [0] * (max_num_blocks - len(row)))
    return NativeDecode(
        token_idx=torch.tensor([s.start for s in decode]).to(device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32).to(device),
        context_lens=torch.tensor([s.context_len for s in decode], dtype=torch.int32).to(device),
    )
