"""Greedy sampling's argmax over a step's logits: csrc/argmax.c on the CPU, torch elsewhere.

Same answer as `logits.max(dim=-1).indices` (the first index of the maximum; a NaN counts as the
maximum), so greedy output still equals `model.generate`'s. On the CPU two vector passes over
each row in C (its max, then the first index holding it) run at memory speed, which torch's
max(dim=-1) on bf16 logits does not (see the C file). `argmax_rows_masked` is structured output's
greedy pick: the grammar's bitmask read in the same passes instead of a masked copy of the logits.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES

SOURCE = loader.CSRC / "argmax.c"


_ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int)


_MASKED_ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)


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


def argmax_rows_masked(logits: torch.Tensor, bitmask: torch.Tensor, word_rows: list[int]) -> list[int] | None:
    """The first maximal index of each row of logits [num_rows, vocab_size] among the tokens its
    bitmask row allows: row r reads bitmask[word_rows[r]] (int32 words, bit t % 32 of word t // 32;
    tokens past the words forbidden), or nothing where word_rows[r] < 0. The same answer as
    argmax_rows over a copy with -inf at the forbidden tokens; None where the kernel cannot run."""
    if (logits.device.type != "cpu" or logits.dtype not in FLOAT_CODES or logits.dim() != 2
            or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or len(word_rows) != logits.shape[0]):
        return None
    fn = loader.load_function(SOURCE, "argmax_rows_masked", _MASKED_ARGTYPES)
    if fn is None:
        return None
    words = bitmask.contiguous()
    index = torch.tensor(word_rows, dtype=torch.int64)
    assert index.numel() == 0 or int(index.max()) < words.shape[0], "a row reads a bitmask row that is not there"
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    fn(logits.data_ptr(), FLOAT_CODES[logits.dtype], rows, cols, logits.stride(0), words.data_ptr(), words.shape[1],
       index.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out.tolist()
