"""ctypes binding of csrc/kv_quant_write.c: the int8 KV cache's write (engine/kv/quant.py) as one C
call per layer, quantizing the step's new K and V and scattering values and scales into the pages.

The same bytes as kv_quant's torch ops (tests/engine/kv/test_kv_quant.py compares them); those stay
the path where this library cannot be built (BATCHGEN_NO_NATIVE=1, no C compiler) and on CUDA.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES

SOURCE = loader.CSRC / "kv_quant_write.c"
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class KvQuantWriteKernel:
    def __init__(self, lib: ctypes.CDLL):
        self._write = lib.kv_quant_write
        self._write.argtypes = [_P, _P, _I, _L, _L, _L, _L, _P, _L, _L, _L, _L, _P, _P, _P, _P, _I]
        self._write.restype = _L

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
              slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """kv_quant.write's effect: k, v [T, kv_heads, head_dim] (any token and head strides) quantized
        into k_cache, v_cache [num_slots, kv_heads, head_dim] and k_scale, v_scale [num_slots, kv_heads]
        at slot_mapping [T]. False, with nothing written, where the kernel does not apply: tensors
        not on the CPU, K/V neither float32 nor bf16, pages not int8 with bf16 scales.
        (Called per layer and step: the checks are the cheap tensor attributes.)"""
        code = FLOAT_CODES.get(k.dtype)
        if (code is None or not k.is_cpu or v.dtype != k.dtype or k.dim() != 3 or k_cache.dtype != torch.int8
                or k_scale.dtype != torch.bfloat16):
            return False
        k_strides, v_strides = k.stride(), v.stride()
        if k_strides[2] != 1:  # the C loop reads head_dim contiguously; token and head strides are free
            k = k.contiguous()
            k_strides = k.stride()
        if v_strides[2] != 1:
            v = v.contiguous()
            v_strides = v.stride()
        tokens, heads, head_dim = k.shape
        num_slots = k_cache.shape[0]
        if (v.shape != k.shape or k_cache.shape != (num_slots, heads, head_dim) or v_cache.shape != k_cache.shape
                or k_scale.shape != (num_slots, heads) or v_scale.shape != k_scale.shape
                or slot_mapping.shape != (tokens,)):
            raise ValueError(f"K {tuple(k.shape)}, V {tuple(v.shape)} and slots {tuple(slot_mapping.shape)} do not "
                             f"fit pages {tuple(k_cache.shape)} with scales {tuple(k_scale.shape)}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_scale.is_contiguous()
                and v_scale.is_contiguous()):  # as kv_cache.py allocates them
            raise ValueError("the int8 KV write needs contiguous pages and scales")
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        slots = slots.contiguous()
        bad = self._write(k.data_ptr(), v.data_ptr(), code, k_strides[0], k_strides[1], v_strides[0], v_strides[1],
                          slots.data_ptr(), tokens, heads, head_dim, num_slots, k_cache.data_ptr(),
                          v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), torch.get_num_threads())
        if bad:
            raise IndexError(f"{bad} of {tokens} cache slots are outside [0, {num_slots})")
        return True


@functools.cache
def load() -> KvQuantWriteKernel | None:
    """The kernel, built on first use; None where it cannot be built (loader.load_library logs why)."""
    lib = loader.load_library(SOURCE)
    return KvQuantWriteKernel(lib) if lib is not None else None
