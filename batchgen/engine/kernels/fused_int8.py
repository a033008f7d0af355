"""ctypes bindings of csrc/pointwise.c's int8 activation passes, for engine/quant/int8.py's
layers: per-token quantizers (symmetric, + 128 for VNNI's u8 operand, with a per-column factor,
asymmetric) and `finish_rows`, the per-token scale, zero points and outlier channels after the
int8 matmul in one pass. engine/kernels/fused.py's PointwiseKernels extends this class: one library."""

from __future__ import annotations

import ctypes

import torch

DTYPE_CODES = {torch.bfloat16: 1, torch.float32: 0}
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class Int8RowKernels:
    def __init__(self, lib: ctypes.CDLL):
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
        self._quant_u8_scaled(x.data_ptr(), 1 if x.dtype == torch.bfloat16 else 0, colscale.data_ptr(), q.data_ptr(),
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
        self._quant_asym(x.data_ptr(), 1 if x.dtype == torch.bfloat16 else 0,
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
        self._finish(acc.data_ptr(), DTYPE_CODES[acc.dtype], out.data_ptr(), DTYPE_CODES[dtype], scale.data_ptr(),
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
        fn(x.data_ptr(), 1 if x.dtype == torch.bfloat16 else 0, q.data_ptr(), scale.data_ptr(), rows, cols,
           torch.get_num_threads())
        return q, scale
