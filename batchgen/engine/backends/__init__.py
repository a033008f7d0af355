"""Attention backends: small objects (`build_metadata`, `forward`) chosen once per engine."""

from batchgen.engine.backends.base import AttentionBackend, LayerKV, PackedSeq
from batchgen.engine.backends.flash import FLASH_BLOCK_SIZE_MULTIPLE, FlashBackend
from batchgen.engine.backends.native_cpu import NativeCpuBackend
from batchgen.engine.backends.sdpa import SdpaBackend

BACKENDS = {b.name: b for b in (SdpaBackend, NativeCpuBackend, FlashBackend)}

__all__ = ["BACKENDS", "FLASH_BLOCK_SIZE_MULTIPLE", "AttentionBackend", "FlashBackend", "LayerKV",
           "NativeCpuBackend", "PackedSeq", "SdpaBackend"]
