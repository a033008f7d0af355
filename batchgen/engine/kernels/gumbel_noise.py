"""The sampler's Gumbel noise on the CPU: csrc/gumbel_noise.c; None where it cannot run.

engine/sampling/random_stream.py defines the noise and computes it with torch ops on other devices;
on the CPU this computes the same values in one pass (see the C file for why).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.engine.kernels import loader

SOURCE = loader.CSRC / "gumbel_noise.c"
_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p, ctypes.c_int)


def gumbel_noise(key_lo: torch.Tensor, key_hi: torch.Tensor, token_ids: torch.Tensor, salt: int,
                 uniform_bits: int) -> torch.Tensor | None:
    """key_lo, key_hi: [rows, 1] int32; token_ids: [rows, n] or [n] int64. Returns [rows, n] float32."""
    if key_lo.device.type != "cpu" or token_ids.device.type != "cpu" or token_ids.dtype != torch.int64:
        return None
    fn = loader.load_function(SOURCE, "gumbel_noise", _ARGTYPES)
    if fn is None:
        return None
    lo = key_lo.reshape(-1).contiguous()
    hi = key_hi.reshape(-1).contiguous()
    ids = token_ids.contiguous()
    rows, n = lo.shape[0], ids.shape[-1]
    out = torch.empty(rows, n, dtype=torch.float32)
    fn(lo.data_ptr(), hi.data_ptr(), ids.data_ptr(), rows, n, n if ids.dim() == 2 else 0, salt & 0xFFFFFFFF,
       uniform_bits, out.data_ptr(), torch.get_num_threads())
    return out
