"""The sampler's candidate window on the CPU: csrc/sample_window.c; None where it cannot run.

For each row: its `window` largest values of logit / temperature (descending, ties by lower id),
their token ids, and the row's logsumexp of logit / temperature, read straight from the model's
bf16 or float32 logits (engine/sampling/draw.py uses them in place of a division, topk and
logsumexp over the whole [rows, vocab] block).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES

SOURCE = loader.CSRC / "sample_window.c"


_ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)


def _kernel():
    return loader.load_function(SOURCE, "sample_window", _ARGTYPES)


def sample_window(logits: torch.Tensor, temperature: torch.Tensor,
                  window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """logits: [rows, vocab_size] on the CPU; temperature: [rows] float32; window < vocab_size.
    Returns (values [rows, window] float32, ids [rows, window] int64, logsumexp [rows] float32)."""
    fn = _kernel() if logits.device.type == "cpu" and logits.dtype in FLOAT_CODES else None
    if fn is None or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    rows, cols = logits.shape
    temperature = temperature.to(torch.float32).contiguous()
    values = torch.empty(rows, window, dtype=torch.float32)
    ids = torch.empty(rows, window, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    fn(logits.data_ptr(), FLOAT_CODES[logits.dtype], rows, cols, logits.stride(0), temperature.data_ptr(), window,
       values.data_ptr(), ids.data_ptr(), lse.data_ptr(), torch.get_num_threads())
    return values, ids, lse
