"""Attention backends: small objects (`build_metadata`, `forward`) chosen once per engine."""

from batchgen.engine.attention.base import AttentionBackend, LayerKV, PackedSeq
from batchgen.engine.attention.flash import FLASH_BLOCK_SIZE_MULTIPLE, FlashBackend
from batchgen.engine.attention.native_cpu import NativeCpuBackend
from batchgen.engine.attention.sdpa import SdpaBackend

BACKENDS = {b.name: b for b in (SdpaBackend, NativeCpuBackend, FlashBackend)}

__all__ = ["BACKENDS", "FLASH_BLOCK_SIZE_MULTIPLE", "AttentionBackend", "FlashBackend", "LayerKV",
           "NativeCpuBackend", "PackedSeq", "SdpaBackend"]
