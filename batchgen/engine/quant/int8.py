"""int8 x int8 linear layers on oneDNN's AMX/VNNI kernels: `--quantize int8 --quantize-backend onednn`.

torchao's dynamic-activation int8 path runs eagerly on aten's `_int_mm`, which on CPU is not a
VNNI/AMX kernel, so it runs slower than the bf16 matmul it replaces. oneDNN's quantized matmul
(`torch.ops.onednn.qlinear_pointwise`, the op inductor's x86 int8 lowering emits) is: on an AMX Xeon
it runs `brg_matmul:avx10_1_512_amx`, on an AVX-512 VNNI CPU `brg_matmul:avx512_core_vnni`
(ONEDNN_VERBOSE=1 shows which). So each decoder linear layer is swapped for Int8DynamicLinear (a
module swap; the HF forward is unchanged):

    weight   int8 [out, in], symmetric per output channel, float32 scales; reordered once into
             oneDNN's blocked layout (`qlinear_prepack`), the only copy kept
    input    symmetric int8 per token (row), quantized on each call by one fused C pass
             (csrc/pointwise.c: quantize_rows_u8; eagerly it is six passes, as slow as the matmul),
             stored as uint8 with zero point 128 (q + 128): VNNI's instruction multiplies u8 by s8,
             and without AMX oneDNN has no fast kernel for s8 x s8. On an AMD EPYC with
             avx512_vnni (no AMX) s8 activations run oneDNN's `ref_int8` reference matmul, far slower
             than bf16; u8 ones run `brg_matmul:avx512_core_vnni`. oneDNN folds the zero point into a
             per-column compensation computed when the weight is reordered (`zpm2` in its verbose)
    output   oneDNN computes (q_x @ q_w^T) * w_scale in int32 -> bf16; the per-token scale is applied
             after (oneDNN's op takes one activation scale per tensor), then the bias
    outliers optional input channels O kept out of the int8 matmul (engine/quant/outliers.py):
             the quantizer reads them as 0, their int8 weight columns are 0, and x[:, O] @ W[:, O]^T
             is added in float32 from the model dtype's values, in the C pass that applies the per-token
             scale (csrc/finish_rows.h; bf16 dot products for a bf16 model)

CPU only, float32 or bf16 activations; without oneDNN's ops or a C compiler for the quantizer,
`supported()` is False and --quantize-backend onednn is refused.
"""

from __future__ import annotations

import torch

from batchgen.engine.kernels import pointwise
from batchgen.engine.quant import outliers as quantize_outliers
from batchgen.engine.quant.embedding import quantize_rows

ZERO_POINT = 128  # of the uint8 activations: q + 128 for symmetric q in -127..127


def cpu_has_int8_matmul() -> bool:
    """Whether this CPU has int8 dot-product instructions oneDNN's int8 matmul runs on (AVX-512 VNNI
    or AMX): where `--quantize int8 --quantize-backend auto` picks onednn over torchao."""
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, probe, lambda: False)()) for probe in ("_is_vnni_supported", "_is_amx_tile_supported"))


def supported(device_type: str) -> bool:
    return (device_type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")
            and _kernels() is not None)


def _kernels():
    return pointwise.load_cached()


class Int8DynamicLinear(torch.nn.Module):
    """`nn.Linear` with int8 weights and per-token int8 activations (see the module docstring)."""

    def __init__(self, linear: torch.nn.Linear, outliers: torch.Tensor | None = None, asymmetric: bool = False):
        """`outliers`: int64 indices of input channels computed in the model dtype, outside the int8
        matmul (engine/quant/outliers.py). `asymmetric`: per-token asymmetric activations (a zero
        point per row, pointwise.quantize_rows_u8_asym) instead of symmetric ones."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        weight = linear.weight.detach()
        # the activation quantizer's per-column factor: 0 at the outlier channels, else 1; None: no outliers
        colscale = None
        self.register_buffer("outliers", None)  # [k] int64
        # W[:, outliers]^T: a bf16 model's in finish_rows' bf16 dot-product layout
        # (quantize_outliers.pack_bf16_pairs: the bf16 weights as they are), else [k, out] float32
        self.register_buffer("outlier_weight", None)
        if outliers is not None and outliers.numel():
            self.outliers = outliers.to(torch.int64).contiguous()
            rows = linear.weight.detach()[:, self.outliers].t()
            self.outlier_weight = (quantize_outliers.pack_bf16_pairs(rows) if self.out_dtype == torch.bfloat16
                                   else rows.float().contiguous())
            weight = weight.float().clone()
            weight[:, self.outliers] = 0  # their share of the product is the full-precision matmul's
            colscale = torch.ones(self.in_features)
            colscale[self.outliers] = 0  # read as 0: they neither set a token's scale nor add to the int8 sum
        self.register_buffer("colscale", colscale)
        qweight, scale = quantize_rows(weight, torch.float32)
        self.packed_weight = torch.ops.onednn.qlinear_prepack(qweight, None)  # opaque oneDNN tensor
        self.register_buffer("weight_scale", scale)  # [out] float32
        self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.int64))
        # asymmetric: scale * sum_j qW[n][j] per output n, what a row's zero point takes off its product
        self.register_buffer("weight_colsum", (qweight.float().sum(1) * scale).contiguous() if asymmetric else None)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.out_dtype or not flat.is_contiguous():
            flat = flat.to(self.out_dtype).contiguous()
        if self.weight_colsum is None and self.outliers is None:
            q, x_scale = _kernels().quantize_rows_u8(flat)  # symmetric int8 + 128: see the module docstring
            out = torch.ops.onednn.qlinear_pointwise(q, 1.0, ZERO_POINT, self.packed_weight, self.weight_scale,
                                                     self.weight_zero_point, None, 1.0, 0, self.out_dtype,
                                                     "none", [], "")
            out.mul_(x_scale.to(self.out_dtype))  # the per-token scale, [rows, 1]
        else:
            out = self._finish_in_c(flat)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _finish_in_c(self, flat: torch.Tensor) -> torch.Tensor:
        """The int8 product with asymmetric activations and/or outlier channels: the per-token scale,
        the zero points' correction and x[:, O] @ W[:, O]^T in one C pass (csrc/pointwise.c:
        finish_rows), rounded once. With asymmetric activations oneDNN multiplies q at zero point 0
        into float32; the correction zp * colsum(W) would cancel too much of a bf16 output."""
        kernels = _kernels()
        zero = None
        if self.weight_colsum is not None:
            q, x_scale, zero = kernels.quantize_rows_u8_asym(flat, self.colscale)
        else:
            q, x_scale = kernels.quantize_rows_u8_scaled(flat, self.colscale)
        acc = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0 if zero is not None else ZERO_POINT, self.packed_weight,
                                                 self.weight_scale, self.weight_zero_point, None, 1.0, 0,
                                                 torch.float32 if zero is not None else self.out_dtype,
                                                 "none", [], "")
        return kernels.finish_rows(acc, self.out_dtype, x_scale.view(-1), zero, self.weight_colsum, flat,
                                   self.outliers, self.outlier_weight)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: the weight this layer multiplies by (for tests and references)."""
        eye = torch.eye(self.in_features, dtype=torch.uint8).add_(ZERO_POINT)
        ones = torch.ops.onednn.qlinear_pointwise(eye, 1.0, ZERO_POINT, self.packed_weight, self.weight_scale,
                                                  self.weight_zero_point, None, 1.0, 0, torch.float32, "none", [], "")
        if self.outliers is not None:  # their rows are 0 in the int8 weight
            ones[self.outliers] = self.outlier_rows()
        return ones.t().contiguous()

    def outlier_rows(self) -> torch.Tensor:
        """[k, out] float32: the outlier channels' weight rows, W[:, outliers]^T."""
        if self.outlier_weight.dtype == torch.bfloat16:
            return quantize_outliers.unpack_bf16_pairs(self.outlier_weight, self.outliers.numel(),
                                                       self.out_features).float()
        return self.outlier_weight

    def extra_repr(self) -> str:
        kept = "" if self.outliers is None else f", {self.outliers.numel()} outlier channels in {self.out_dtype}"
        kept += ", asymmetric activations" if self.weight_colsum is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 x int8 (oneDNN){kept}"


def quantize_linear(parent: torch.nn.Module, child: str, outliers: torch.Tensor | None = None,
                    asymmetric: bool = False) -> None:
    setattr(parent, child, Int8DynamicLinear(getattr(parent, child), outliers, asymmetric))
