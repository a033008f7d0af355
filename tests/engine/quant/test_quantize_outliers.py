"""LLM.int8()-style outlier channels of the oneDNN int8 layers (engine/quant/outliers.py,
engine/quant/int8.py): the channels chosen, the split product, and the recipe applying it."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import int8_siblings as quantize_int8_siblings
from batchgen.engine.quant import outliers as quantize_outliers
from batchgen.engine.quant import quantize
from batchgen.engine.quant.calibration import input_ranges
from batchgen.engine.quant.recipe import INT8_OUTLIER_FRACTION
from tests.engine.greedy_pair import generate_and_engine_tokens
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not quantize_int8.supported("cpu"), reason="no oneDNN quantized ops or C compiler")
CALIBRATION = [[5 + (11 * i + j) % 250 for j in range(40)] for i in range(3)]


def test_the_channels_chosen_are_the_widest_the_quantizer_sees():
    ranges = torch.tensor([1.0, 50.0, 2.0, 9.0, 0.5, 30.0, 3.0, 1.0])
    assert quantize_outliers.outlier_channels(ranges, 0.0) is None
    assert quantize_outliers.outlier_channels(ranges, 0.25).tolist() == [1, 5]  # ceil(0.25 * 8) = 2, sorted
    assert quantize_outliers.outlier_channels(ranges, 0.01).tolist() == [1]  # at least one


def reference(x: torch.Tensor, weight: torch.Tensor, outliers: list[int]) -> torch.Tensor:
    """float64: the regular channels as symmetric int8 per token x int8 per output row, plus the
    outlier channels' exact product."""
    x, w = x.double(), weight.float()
    regular = torch.ones(x.shape[1], dtype=torch.bool)
    regular[outliers] = False
    xr = x * regular
    x_scale = xr.abs().amax(1, keepdim=True) / 127
    qx = (xr / x_scale).round().clamp(-127, 127)
    wr = w * regular  # the weight is quantized in float32, as quantize_rows does
    w_scale = wr.abs().amax(1, keepdim=True) / 127
    qw = (wr / w_scale).round().clamp(-127, 127)
    return (qx @ qw.double().T) * x_scale * w_scale.double().T + x[:, outliers] @ w[:, outliers].double().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_computes_int8_plus_the_outliers_exact_product(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 64, bias=False).to(dtype)
    x = torch.randn(11, 96, dtype=dtype)
    x[:, 7] *= 80  # outlier channels, as decoder inputs have
    x[:, 40] *= 30
    outliers = quantize_outliers.outlier_channels(x.float().abs().amax(0), 0.02)
    assert outliers.tolist() == [7, 40]
    layer = quantize_int8.Int8DynamicLinear(linear, outliers=outliers)
    got = layer(x).double()
    want = reference(x, linear.weight, [7, 40])
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * want.abs().max()
    # the weight it multiplies by: the outlier columns exact, the rest int8
    w = linear.weight.float()
    deq = layer.dequantized_weight()
    assert torch.equal(deq[:, [7, 40]], w[:, [7, 40]])
    torch.testing.assert_close(deq, w, atol=w.abs().max().item() / 127, rtol=0)
    # and taking the outliers out is what brings it near the float layer
    exact = x.double() @ w.double().T
    plain = quantize_int8.Int8DynamicLinear(linear)(x).double()
    assert (got - exact).norm() < 0.25 * (plain - exact).norm()


def test_bf16_pairs_layout_round_trips_and_holds_row_pairs_per_lane():
    w = torch.randn(5, 40).to(torch.bfloat16)  # odd k, a partial last block of 16 columns
    packed = quantize_outliers.pack_bf16_pairs(w)
    assert packed.shape == (3, 3, 16, 2) and packed.dtype == torch.bfloat16
    assert torch.equal(packed[1, 2, 3], torch.stack([w[4, 19], torch.tensor(0, dtype=torch.bfloat16)]))
    assert torch.equal(packed[0, 0, 5], w[0:2, 5])
    assert packed[2, :, 8:].eq(0).all()  # columns 40..47 pad
    assert torch.equal(quantize_outliers.unpack_bf16_pairs(packed, 5, 40), w)


@pytest.mark.parametrize("k", [1, 6, 7])
def test_finish_rows_bf16_dot_products_equal_the_float64_sum(k):
    """The bf16 model's outlier update (vdpbf16ps on the pairs layout): bf16 inputs times bf16
    weights summed in float32, so within a bf16 rounding of the float64 result."""
    kernels = quantize_int8._kernels()
    torch.manual_seed(3)
    rows, cols, in_f = 11, 40, 24  # a partial block of 8 rows and of 16 columns
    acc = torch.randn(rows, cols, dtype=torch.float32)
    scale = torch.rand(rows) + 0.5
    x = (torch.randn(rows, in_f) * 20).to(torch.bfloat16)
    idx = torch.randperm(in_f)[:k].sort().values
    w = torch.randn(k, cols).to(torch.bfloat16)
    got = kernels.finish_rows(acc, torch.bfloat16, scale, x=x, idx=idx,
                              outlier_weight=quantize_outliers.pack_bf16_pairs(w)).double()
    want = acc.double() * scale.double()[:, None] + x[:, idx].double() @ w.double()
    assert (got - want).abs().max() <= 2 ** -8 * want.abs().max()
    f32 = kernels.finish_rows(acc, torch.bfloat16, scale, x=x, idx=idx, outlier_weight=w.float().contiguous())
    assert (got - f32.double()).abs().max() <= 2 ** -8 * want.abs().max()  # the float32 FMAs' result, up to sum order


def test_stacked_siblings_take_the_same_outliers_as_single_layers():
    torch.manual_seed(2)
    linears = [torch.nn.Linear(64, out, bias=False).to(torch.bfloat16) for out in (64, 32, 32)]
    outliers = torch.tensor([5, 17])
    group = quantize_int8_siblings.SiblingGroup(linears, outliers=outliers)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    x[:, 5] *= 60
    with torch.inference_mode():
        for i, lin in enumerate(linears):
            single = quantize_int8.Int8DynamicLinear(lin, outliers=outliers)
            assert torch.equal(quantize_int8_siblings.Int8SiblingLinear(group, i)(x), single(x))


def test_the_recipe_takes_outliers_in_every_layer():
    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    down_weight = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    names = quantize.quantizable_linear_names(model, 1)
    ranges = input_ranges(model, names, CALIBRATION)
    quantize.quantize_model(model, "int8", "onednn", embedding="none", calibration=CALIBRATION)
    layer = model.model.layers[0]
    # the widest channels by calibrated range, ceil(INT8_OUTLIER_FRACTION * in) of them; a stacked
    # set by its shared input (its first child's)
    for name, module in (("mlp.down_proj", layer.mlp.down_proj), ("self_attn.o_proj", layer.self_attn.o_proj),
                         ("self_attn.q_proj", layer.self_attn.q_proj.group.linear),
                         ("mlp.gate_proj", layer.mlp.up_proj.group.linear)):
        seen = ranges[f"model.layers.0.{name}"]
        k = math.ceil(module.in_features * INT8_OUTLIER_FRACTION)
        assert module.outliers is not None and set(module.outliers.tolist()) == set(seen.topk(k).indices.tolist())
    down = layer.mlp.down_proj
    assert down.outlier_weight.dtype == torch.bfloat16  # the bf16 model's dot-product layout
    assert torch.equal(down.outlier_rows(), down_weight[:, down.outliers].t().float())


def test_engine_greedy_equals_generate_of_the_calibrated_model(tokenizer):
    model = make_tiny_model("llama", seed=6)  # float32: the engine's tokens equal generate's exactly
    quantize.quantize_model(model, "int8", "onednn", calibration=CALIBRATION)
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.outliers is not None and layer.mlp.down_proj.weight_colsum is not None
    assert layer.self_attn.o_proj.outliers is not None and layer.self_attn.o_proj.weight_colsum is None
    refs, got = generate_and_engine_tokens(model, tokenizer)
    assert got == refs
