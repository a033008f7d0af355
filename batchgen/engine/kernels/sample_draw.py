"""A step's whole sampled draw on the CPU: csrc/sample_draw.c; None where it cannot run.

engine/sampling/draw.py uses it for the rows of a step that ask for no logprobs: the same token as
its window path, without the window's tensors (see the C file for why and how).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES

SOURCE = loader.CSRC / "sample_draw.c"
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, ctypes.c_int, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, ctypes.c_uint32, ctypes.c_int, _P,
             ctypes.c_int)


def sample_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, window: int, salt: int,
                uniform_bits: int) -> torch.Tensor | None:
    """logits: [rows, vocab_size] on the CPU; the settings [rows] each: temperature, top_p, min_p
    float32, top_k, seeds, positions int64. Returns the drawn token ids, [rows] int64."""
    if logits.device.type != "cpu" or logits.dtype not in FLOAT_CODES or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    fn = loader.load_function(SOURCE, "sample_draw", _ARGTYPES)
    if fn is None:
        return None
    rows, cols = logits.shape
    settings = [t.contiguous() for t in (temperature.to(torch.float32), top_k.to(torch.int64), top_p.to(torch.float32),
                                         min_p.to(torch.float32), seeds.to(torch.int64), positions.to(torch.int64))]
    assert all(t.shape == (rows,) for t in settings)
    out = torch.empty(rows, dtype=torch.int64)
    fn(logits.data_ptr(), FLOAT_CODES[logits.dtype], rows, cols, logits.stride(0), *(t.data_ptr() for t in settings),
       window, salt & 0xFFFFFFFF, uniform_bits, out.data_ptr(), torch.get_num_threads())
    if bool((out < 0).any()):
        raise MemoryError("sampled draw: out of memory for a row's scratch buffers")
    return out
