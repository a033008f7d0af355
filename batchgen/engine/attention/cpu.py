"""The CPU default: decode through the C kernel that reads K/V in place from the pages
(engine/kernels/paged_decode.py), prefill chunks through the C prefill kernel
(engine/kernels/prefill_attention.py) where it has one for the dtypes and head size (int8 pages
included), else through the SDPA backend's path. Both kernels honour a layer's sliding window,
softcap and sinks (engine/score_rules.py's ScoreRules)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.attention.base import DEFAULT_BLOCK_SIZE, LayerKV
from batchgen.engine.attention.sdpa import PrefillSeq, build_prefills, prefill_forward
from batchgen.engine.kernels import paged_decode, prefill_attention
from batchgen.engine.packed_seq import PackedSeq, block_table_tensor
from batchgen.engine.score_rules import NO_RULES, ScoreRules


@dataclass(slots=True)
class NativeDecode:
    """Every decode sequence of the step for the CPU kernel."""

    token_idx: torch.Tensor  # [B] positions of their query tokens in the packed row
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with block 0 (never read)
    context_lens: torch.Tensor  # [B] int32


@dataclass(slots=True)
class NativeMetadata:
    decode: NativeDecode | None
    prefill: prefill_attention.PrefillBatch | None  # the step's prefill sequences for the C kernel
    seqs: list[PackedSeq] = field(default_factory=list)
    block_size: int = 0
    device: torch.device | None = None
    _sdpa_prefills: list[PrefillSeq] | None = None

    def sdpa_prefills(self) -> list[PrefillSeq]:
        """The SDPA path's prefill metadata, built at the first layer that needs it (a dtype or head
        size the C prefill kernel lacks, or a CPU without it) and shared by the others."""
        if self._sdpa_prefills is None:
            self._sdpa_prefills = build_prefills(self.seqs, self.block_size, self.device)
        return self._sdpa_prefills


class CpuBackend:
    name = "cpu"
    describe = "the C kernels"
    default_block_size = DEFAULT_BLOCK_SIZE
    block_size_multiple = 1
    reads_int8_pages = True
    supports_cuda_graphs = False
    score_rules = frozenset({"sliding_window", "softcap", "sinks"})

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return (device.type == "cpu" and paged_decode.PagedDecodeKernel.supports(dtype, dtype)
                and paged_decode.load() is not None)

    @staticmethod
    def requirement(device: torch.device, dtype: torch.dtype) -> str:
        return (f"the cpu attention backend needs a CPU model in float32 or bfloat16 (got {device.type}, "
                f"{dtype}) and a C compiler to build its kernel")

    def build_metadata(self, seqs: list[PackedSeq], block_size: int, device: torch.device) -> NativeMetadata:
        decode = [s for s in seqs if s.num_new_tokens == 1]
        return NativeMetadata(_native_decode(decode, block_size, device) if decode else None,
                              prefill_attention.PrefillBatch.build(seqs, block_size), seqs, block_size, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, metadata: NativeMetadata,
                scale: float, rules: ScoreRules = NO_RULES) -> torch.Tensor:
        out = q.new_empty(q.shape)  # dense [T, num_heads, head_dim], whatever q's strides
        scales = None if layer.k_scale is None else (layer.k_scale, layer.v_scale)
        nd = metadata.decode
        if nd is not None:
            od = paged_decode.load()(q.index_select(0, nd.token_idx), layer.k_cache, layer.v_cache, nd.block_tables,
                               nd.context_lens, layer.block_size, scale, scales, rules)
            out.index_copy_(0, nd.token_idx, od)
        if metadata.prefill is not None:
            kernel = prefill_attention.load()
            # the kernel reads the pages, which already hold this step's K/V (attention.py writes
            # first): int8 pages give the new tokens as the cache stores them, as every later read
            if kernel is not None and kernel.supports(q.dtype, layer.k_cache.dtype, q.shape[2]):
                kernel(q.contiguous(), out, layer.k_cache, layer.v_cache, metadata.prefill, layer.block_size, scale,
                       scales, rules)
            else:
                prefill_forward(q, k, v, layer, metadata.sdpa_prefills(), scale, out, rules)
        return out


def _native_decode(decode: list[PackedSeq], block_size: int, device: torch.device) -> NativeDecode:
    return NativeDecode(
        token_idx=torch.tensor([s.start for s in decode]).to(device),
        block_tables=block_table_tensor(decode, block_size).to(device),
        context_lens=torch.tensor([s.context_len for s in decode], dtype=torch.int32).to(device),
    )
