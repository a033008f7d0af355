"""score's log-probability of each row's target token over the LM head's logits: csrc/target_logprob.c
on the CPU (two passes over each row where it lies), torch's log_softmax elsewhere. Same values as
`logits.float().log_softmax(-1).gather(1, targets[:, None])` within float32 rounding (see the C file)."""

from __future__ import annotations

import ctypes

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES

SOURCE = loader.CSRC / "target_logprob.c"
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float64 [rows]: log_softmax(logits[r])[targets[r]] of logits [rows, vocab] (any float dtype)."""
    fn = None
    if logits.device.type == "cpu" and logits.dtype in FLOAT_CODES and logits.dim() == 2 and logits.stride(1) == 1:
        fn = loader.load_function(SOURCE, "target_logprob_rows", _ARGTYPES)
    if fn is None:
        return logits.float().log_softmax(-1).gather(1, targets[:, None])[:, 0].double()
    rows, cols = logits.shape
    targets = targets.to(torch.int64).contiguous()
    assert targets.shape == (rows,) and (not rows or 0 <= int(targets.min()) <= int(targets.max()) < cols)
    out = torch.empty(rows, dtype=torch.float64)
    fn(logits.data_ptr(), FLOAT_CODES[logits.dtype], rows, cols, logits.stride(0), targets.data_ptr(),
       out.data_ptr(), torch.get_num_threads())
    return out
