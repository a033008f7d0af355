"""CPU linear layers on oneDNN weights reordered once.

`F.linear` on a bf16 CPU tensor runs oneDNN's matmul (AMX or AVX-512 BF16 kernels), which first
reorders the weight into the kernel's blocked layout, on every call. For a decode step of a few
dozen tokens that reorder is a large share of the call; at prefill sizes the matmul dominates
and the reorder matters little either way. So each linear layer gains a reordered copy, used for
calls of every size in float32 and bfloat16 (ALL_ROWS_DTYPES) and of at most SMALL_M_MAX rows in
float16 (not tried at prefill sizes). `python -m benchmarks.kernels.linear_kernels` compares the two per
shape and row count.

float32 gains the most: `F.linear` runs MKL's sgemm there, which takes its AVX2 path on AMD CPUs,
while oneDNN on the reordered weight uses the CPU's AVX-512 at every row count, as vLLM-CPU also
runs its float32 linears on oneDNN. The two
sum in another order (about 1e-6 relative), as the engine's packed forward already did against
`model.generate`'s padded one; the greedy-equivalence tests hold on it.

The layers stay the model's own `nn.Linear` modules (names, parameters, state dict, tied weights
untouched); only their `forward` is replaced, per instance. The copy costs the linear weights'
bytes once more, so it is made only when that fits in MAX_EXTRA_MEMORY_SHARE of the memory
available; a larger model keeps the plain path (a log line says so).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from batchgen.engine.memory import available_cpu_bytes

log = logging.getLogger(__name__)

# calls with at most this many rows (tokens) use the reordered weight (where the reorder stops
# mattering: see the module docstring)
SMALL_M_MAX = 256
# the reorder's kernel choice is tuned for this many rows; any row count runs on the result
PACK_ROWS_HINT = 64
# the copies may take at most this share of MemAvailable (the KV cache is sized after them)
MAX_EXTRA_MEMORY_SHARE = 0.25
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# dtypes whose calls of any size take the reordered weight: float32 (oneDNN beats MKL's AVX2 path
# at every size) and bfloat16 (no worse at prefill sizes); float16 keeps the plain path above
# SMALL_M_MAX rows (not tried there)
ALL_ROWS_DTYPES = (torch.float32, torch.bfloat16)


def supported(model: torch.nn.Module) -> bool:
    """CPU, bf16/fp16/fp32 weights, and a oneDNN build with native kernels for that dtype."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype not in _DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if param.dtype == torch.float32:
        return True
    if param.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def packable_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Plain `nn.Linear` layers with a plain dense weight in the model's dtype (a quantized layer,
    a tensor subclass or a swapped module keeps its own kernel)."""
    dtype = next(model.parameters()).dtype
    out = []
    for module in model.modules():
        if type(module) is not torch.nn.Linear or getattr(module, "_batchgen_packed", None) is not None:
            continue
        w = module.weight
        plain = type(w) is torch.nn.Parameter and type(w.data) is torch.Tensor and w.layout == torch.strided
        if plain and w.dtype == dtype:
            out.append(module)
    return out


def pack_linear_layers(model: torch.nn.Module, available_bytes: int | None = None) -> int:
    """Give each packable linear layer a reordered weight for small calls; returns how many were
    packed (0 when unsupported or too large). Idempotent: a second engine on the model reuses them."""
    if not supported(model):
        return 0
    layers = packable_layers(model)
    extra = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if available_bytes is None:
        available_bytes = available_cpu_bytes()  # the same figure the KV cache is then sized from
    if extra > MAX_EXTRA_MEMORY_SHARE * available_bytes:
        log.debug("linear weights: not reordered for small batches (a copy needs %.0f MiB, more than %.0f%% of "
                  "the %.0f MiB available)", extra / 2**20, 100 * MAX_EXTRA_MEMORY_SHARE, available_bytes / 2**20)
        return 0
    with torch.no_grad():
        for module in layers:
            module._batchgen_packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS_HINT)
            module.forward = types.MethodType(_packed_forward, module)
    if layers:
        rows = "any number of" if _all_rows(layers[0].weight.dtype) else f"<= {SMALL_M_MAX}"
        log.debug("linear weights: %d layers reordered once for calls of %s rows (%.0f MiB)", len(layers),
                  rows, extra / 2**20)
    return len(layers)


def _all_rows(dtype: torch.dtype) -> bool:
    return dtype in ALL_ROWS_DTYPES


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    dtype = self.weight.dtype
    if x.dtype == dtype and (_all_rows(dtype) or x.numel() <= SMALL_M_MAX * self.in_features):
        return torch.ops.mkldnn._linear_pointwise(x, self._batchgen_packed, self.bias, "none", [], "")
    return F.linear(x, self.weight, self.bias)

