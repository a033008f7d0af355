"""ctypes bindings of csrc/pointwise.c, one C call for each pointwise chain: RMSNorm, SiLU(gate) * up
and the rotary embedding (which fused.py gives matching modules of a model), and the int8 layers'
activation passes (engine/quant/int8.py): per-token quantizers (symmetric, + 128 for VNNI's u8
operand, with a per-column factor, asymmetric) and `finish_rows`, the per-token scale, zero points
and outlier channels after the int8 matmul in one pass."""

from __future__ import annotations

import ctypes
import functools

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES

SOURCE = loader.CSRC / "pointwise.c"
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class PointwiseKernels:
    """ctypes bindings of csrc/pointwise.c's functions; the C file states each one's contract."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms = lib.rms_norm
        self._rms.argtypes = [_P, _P, _P, _I, _L, _L, ctypes.c_float, _I]
        self._rms.restype = None
        self._silu = lib.silu_mul
        self._silu.argtypes = [_P, _P, _P, _I, _L, _I]
        self._silu.restype = None
        self._silu_rows = lib.silu_mul_rows  # row-strided gate/up: halves of a stacked matmul's output
        self._silu_rows.argtypes = [_P, _P, _P, _I, _L, _L, _L, _L, _I]
        self._silu_rows.restype = None
        self._rope = lib.rope
        self._rope.argtypes = [_P, _P, _P, _P, _P, _P, _I, _L, _L, _L, _L, _I]
        self._rope.restype = None
        self._quant = lib.quantize_rows_s8  # engine/quant/int8.py's activations
        self._quant_u8 = lib.quantize_rows_u8
        for fn in (self._quant, self._quant_u8):
            fn.argtypes = [_P, _I, _P, _P, _L, _L, _I]
            fn.restype = None
        self._quant_u8_scaled = lib.quantize_rows_u8_scaled  # with a per-column factor (0 at outlier channels)
        self._quant_u8_scaled.argtypes = [_P, _I, _P, _P, _P, _L, _L, _I]
        self._quant_u8_scaled.restype = None
        self._quant_asym = lib.quantize_rows_u8_asym  # per-row zero points (quantize_int8.py's asymmetric layers)
        self._quant_asym.argtypes = [_P, _I, _P, _P, _P, _P, _L, _L, _I]
        self._quant_asym.restype = None
        self._finish = lib.finish_rows  # the per-token scale, zero points and outlier channels in one pass
        self._finish.argtypes = [_P, _I, _P, _I, _P, _P, _P, _P, _L, _P, _L, _P, _I, _L, _L, _I]
        self._finish.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        assert x.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype
        out = torch.empty_like(x)
        cols = x.shape[-1]
        self._rms(x.data_ptr(), weight.data_ptr(), out.data_ptr(), FLOAT_CODES[x.dtype], x.numel() // cols, cols,
                  float(eps), torch.get_num_threads())
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, contiguous; gate and up contiguous, or row-strided (rows_view)."""
        assert gate.shape == up.shape and gate.dtype == up.dtype
        out = torch.empty(gate.shape, dtype=gate.dtype)
        if gate.is_contiguous() and up.is_contiguous():
            self._silu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), FLOAT_CODES[gate.dtype], gate.numel(),
                       torch.get_num_threads())
            return out
        g, u = rows_view(gate), rows_view(up)
        assert g is not None and u is not None
        self._silu_rows(g.data_ptr(), u.data_ptr(), out.data_ptr(), FLOAT_CODES[gate.dtype], g.shape[0], g.shape[1],
                        g.stride(0), u.stride(0), torch.get_num_threads())
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, H, T, D], k [B, KVH, T, D] (token-major memory), cos/sin [B, T, D] -> rotated q, k."""
        assert rope_layout_ok(q, k, cos, sin)
        B, H, T, D = q.shape
        q_out = torch.empty((B, T, H, D), dtype=q.dtype).transpose(1, 2)
        k_out = torch.empty((B, T, k.shape[1], D), dtype=k.dtype).transpose(1, 2)
        self._rope(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
                   FLOAT_CODES[q.dtype], B * T, H, k.shape[1], D, torch.get_num_threads())
        return q_out, k_out

    def quantize_rows_s8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric int8 per row of a 2-D float32/bf16 tensor: (q [rows, cols] int8, scale [rows, 1] float32)."""
        return self._quantize_rows(x, self._quant, torch.int8)

    def quantize_rows_u8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """quantize_rows_s8's values + 128 as uint8 (zero point 128): the operand VNNI multiplies."""
        return self._quantize_rows(x, self._quant_u8, torch.uint8)

    def quantize_rows_u8_scaled(self, x: torch.Tensor, colscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """quantize_rows_u8 of `x * colscale` (colscale: [cols] float32), the product taken in float32."""
        assert x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16)
        assert colscale.dtype == torch.float32 and colscale.is_contiguous() and colscale.shape == (x.shape[1],)
        rows, cols = x.shape
        q = torch.empty(rows, cols, dtype=torch.uint8)
        scale = torch.empty(rows, 1, dtype=torch.float32)
        self._quant_u8_scaled(x.data_ptr(), FLOAT_CODES[x.dtype], colscale.data_ptr(), q.data_ptr(),
                              scale.data_ptr(), rows, cols, torch.get_num_threads())
        return q, scale

    def quantize_rows_u8_asym(self, x: torch.Tensor, colscale: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Asymmetric uint8 per row of `x * colscale` (colscale: [cols] float32 or None):
        (q [rows, cols] uint8, scale [rows] float32, zero point [rows] float32), x ~ (q - zp) * scale."""
        assert x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16)
        assert colscale is None or (colscale.dtype == torch.float32 and colscale.is_contiguous()
                                    and colscale.shape == (x.shape[1],))
        rows, cols = x.shape
        q = torch.empty(rows, cols, dtype=torch.uint8)
        scale, zero_point = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
        self._quant_asym(x.data_ptr(), FLOAT_CODES[x.dtype],
                         None if colscale is None else colscale.data_ptr(), q.data_ptr(), scale.data_ptr(),
                         zero_point.data_ptr(), rows, cols, torch.get_num_threads())
        return q, scale, zero_point

    def finish_rows(self, acc: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor,
                    zero_point: torch.Tensor | None = None, colsum: torch.Tensor | None = None,
                    x: torch.Tensor | None = None, idx: torch.Tensor | None = None,
                    outlier_weight: torch.Tensor | None = None) -> torch.Tensor:
        """(acc - zero_point[:, None] * colsum) * scale[:, None] + x[:, idx] @ outlier_weight in float32,
        rounded once to `dtype` (csrc/finish_rows.h). acc [rows, cols]: float32, or `dtype`
        (then written in place); scale, zero_point [rows] float32; colsum [cols] float32; x [rows, in]
        `dtype`; idx [k] int64; outlier_weight [k, cols] float32, or for a bf16 `dtype` bf16 in the
        dot-product layout of quantize_outliers.pack_bf16_pairs."""
        assert acc.dim() == 2 and acc.is_contiguous() and acc.dtype in (torch.float32, dtype)
        rows, cols = acc.shape
        assert scale.dtype == torch.float32 and scale.is_contiguous() and scale.numel() == rows
        assert (zero_point is None) == (colsum is None) and (zero_point is None or acc.dtype == torch.float32)
        if zero_point is not None:
            assert zero_point.shape == (rows,) and colsum.shape == (cols,) and colsum.dtype == torch.float32
        k = 0 if idx is None else idx.numel()
        if k:
            assert x is not None and x.dtype == dtype and x.is_contiguous() and x.shape[0] == rows
            assert idx.dtype == torch.int64 and outlier_weight.is_contiguous()
            if outlier_weight.dtype == torch.bfloat16:
                assert dtype == torch.bfloat16 and outlier_weight.shape == ((cols + 15) // 16, (k + 1) // 2, 16, 2)
            else:
                assert outlier_weight.dtype == torch.float32 and outlier_weight.shape == (k, cols)
        form = int(bool(k) and outlier_weight.dtype == torch.bfloat16)  # 1: the bf16 pairs layout
        out = acc if acc.dtype == dtype else torch.empty(rows, cols, dtype=dtype)
        self._finish(acc.data_ptr(), FLOAT_CODES[acc.dtype], out.data_ptr(), FLOAT_CODES[dtype], scale.data_ptr(),
                     None if zero_point is None else zero_point.data_ptr(),
                     None if colsum is None else colsum.data_ptr(), None if not k else x.data_ptr(),
                     0 if not k else x.shape[1], None if not k else idx.data_ptr(), k,
                     None if not k else outlier_weight.data_ptr(), form, rows, cols, torch.get_num_threads())
        return out

    def _quantize_rows(self, x: torch.Tensor, fn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16)
        rows, cols = x.shape
        q = torch.empty(rows, cols, dtype=dtype)
        scale = torch.empty(rows, 1, dtype=torch.float32)
        fn(x.data_ptr(), FLOAT_CODES[x.dtype], q.data_ptr(), scale.data_ptr(), rows, cols,
           torch.get_num_threads())
        return q, scale


def rows_view(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with unit column stride and one row stride (a column slice of a wider
    contiguous tensor), or None when its memory is not laid out so."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # rows not evenly strided
        return None


def _token_major(x: torch.Tensor) -> bool:
    """[B, heads, T, D] viewed from [B, T, heads, D] contiguous memory (q_proj(...).view().transpose(1, 2))."""
    B, heads, T, D = x.shape
    return x.stride() == (T * heads * D, D, heads * D, 1) or (x.is_contiguous() and (heads == 1 or T == 1))


def rope_layout_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    B, _, T, D = q.shape
    return (q.dtype in FLOAT_CODES and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype
            and q.device.type == "cpu" and not torch.is_grad_enabled() and D % 2 == 0
            and k.shape[0] == B and k.shape[2] == T and k.shape[3] == D
            and cos.shape == (B, T, D) and sin.shape == (B, T, D) and cos.is_contiguous() and sin.is_contiguous()
            and _token_major(q) and _token_major(k))


def load() -> PointwiseKernels | None:
    """The kernels, built on first use; None where they cannot be built (loader.load_library logs why)."""
    lib = loader.load_library(SOURCE)
    return PointwiseKernels(lib) if lib is not None else None


@functools.cache
def load_cached() -> PointwiseKernels | None:
    """load(), once per process: for callers on the per-call path (engine/quant/int8.py)."""
    return load()
