"""The attention backends by name, and the rules of each: where it runs, its page sizes, what it reads.

Every backend class states its own rules (`available`, `default_block_size`,
`block_size_multiple`, `reads_int8_pages`, `supports_cuda_graphs`); the choice below only reads
them, so a new backend is one class and one line in BACKENDS. The names are config/choices.py's.

auto: flash-attn's paged kernel on CUDA when the package imports (with its own page size, unless
the user set a block size it cannot use); the C kernels on the CPU where they build; torch SDPA
everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.config.choices import AttentionBackendName, canonical_attention_backend
from batchgen.engine.attention.base import AttentionBackend
from batchgen.engine.attention.cpu import CpuBackend
from batchgen.engine.attention.flash import FlashBackend
from batchgen.engine.attention.sdpa import SdpaBackend

BACKENDS: dict[str, type] = {b.name: b for b in (CpuBackend, SdpaBackend, FlashBackend)}
assert set(BACKENDS) == {b.value for b in AttentionBackendName} - {AttentionBackendName.AUTO.value}
SET_BY_FLAG = "set by --attention-backend"


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # a key of BACKENDS
    block_size: int  # tokens per KV page: the user's, else the backend's own
    reason: str  # one line for the log: why this backend


def make_backend(name: str) -> AttentionBackend:
    return BACKENDS[canonical_attention_backend(name)]()


def select_backend(backend: str, device: torch.device, block_size: int | None,
                   dtype: torch.dtype = torch.float32) -> BackendChoice:
    """The attention backend and its page size, with the reason `batchgen run` logs.
    A block size left unset is the chosen backend's."""
    backend = canonical_attention_backend(backend)
    if backend == AttentionBackendName.AUTO:
        backend, reason = _auto_backend(device, block_size, dtype)
    elif backend in BACKENDS:
        reason = SET_BY_FLAG
    else:
        raise ValueError(f"attention backend must be one of {', '.join(b.value for b in AttentionBackendName)}; "
                         f"got {backend!r}")
    cls = BACKENDS[backend]
    if not cls.available(device, dtype):
        raise ValueError(cls.requirement(device, dtype))
    block_size = block_size or cls.default_block_size
    if block_size % cls.block_size_multiple:
        raise ValueError(f"{cls.describe}'s paged KV needs a block size that is a multiple of "
                         f"{cls.block_size_multiple}, got {block_size}")
    return BackendChoice(backend, block_size, reason)


def _auto_backend(device: torch.device, block_size: int | None, dtype: torch.dtype) -> tuple[str, str]:
    if device.type == "cuda":
        if not FlashBackend.available(device, dtype):
            return SdpaBackend.name, "auto: flash-attn is not installed (pip install flash-attn), so torch SDPA"
        if block_size is not None and block_size % FlashBackend.block_size_multiple:
            return SdpaBackend.name, (f"auto: flash-attn is installed but the set block size {block_size} is not "
                                      f"a multiple of {FlashBackend.block_size_multiple}, so torch SDPA")
        return FlashBackend.name, "auto: flash-attn's paged varlen kernel on CUDA"
    if CpuBackend.available(device, dtype):
        return CpuBackend.name, "auto: the C decode kernel on CPU"
    return SdpaBackend.name, f"auto: no C kernel for {device.type} / {dtype} (or no C compiler), so torch SDPA"


def resolve_backend(backend: str, device: torch.device, block_size: int | None,
                    dtype: torch.dtype = torch.float32) -> tuple[str, int]:
    """(backend name, block size) of `select_backend`."""
    choice = select_backend(backend, device, block_size, dtype)
    return choice.name, choice.block_size
