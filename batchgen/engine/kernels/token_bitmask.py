"""Structured output's token mask on the CPU: csrc/token_bitmask.c; None where it cannot run.

engine/sampling/grammar.py unpacks the grammar's bitmask with torch ops on other devices; on the CPU
this writes -inf over each constrained row's forbidden tokens in place (see the C file for why).
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import DTYPE_CODES

SOURCE = loader.CSRC / "token_bitmask.c"
_DTYPE_CODES = {dtype: DTYPE_CODES[dtype] for dtype in (torch.float32, torch.bfloat16, torch.float16)}
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """Set the tokens bitmask row m forbids to -inf in logits row rows[m], in place; False (nothing
    done) where the kernel cannot run on these tensors. logits: [num_rows, vocab_size] on the CPU;
    bitmask: [len(rows), num_words] int32."""
    if (logits.device.type != "cpu" or logits.dtype not in _DTYPE_CODES or logits.dim() != 2
            or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or bitmask.shape[0] != len(rows)):
        return False
    fn = loader.load_function(SOURCE, "apply_token_bitmask", _ARGTYPES)
    if fn is None:
        return False
    words = bitmask.contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    fn(logits.data_ptr(), _DTYPE_CODES[logits.dtype], logits.shape[1], logits.stride(0), words.data_ptr(),
       words.shape[1], index.data_ptr(), len(rows), torch.get_num_threads())
    return True
