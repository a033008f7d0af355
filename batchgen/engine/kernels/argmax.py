"""Greedy sampling's argmax over a step's logits: csrc/argmax.c on the CPU, torch elsewhere.

Same answer as `logits.max(dim=-1).indices` (the first index of the maximum; a NaN counts as the
maximum), so greedy output still equals `model.generate`'s. On the CPU two vector passes over
each row in C (its max, then the first index holding it) run at memory speed, which torch's
max(dim=-1) on bf16 logits does not (see the C file).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES

SOURCE = loader.CSRC / "argmax.c"


_ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int)


def _kernel():
    return loader.load_function(SOURCE, "argmax_rows", _ARGTYPES)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first maximal index of each row of logits [num_rows, vocab_size]."""
    fn = _kernel() if logits.device.type == "cpu" and logits.dtype in FLOAT_CODES else None
    if fn is None or logits.dim() != 2 or logits.stride(1) != 1:
        return logits.max(dim=-1).indices.tolist()
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    fn(logits.data_ptr(), FLOAT_CODES[logits.dtype], rows, cols, logits.stride(0), out.data_ptr(),
       torch.get_num_threads())
    return out.tolist()
