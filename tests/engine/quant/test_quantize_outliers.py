"""LLM.int8()-style outlier channels of the oneDNN int8 layers (engine/quant/outliers.py,
engine/quant/int8.py): the channels chosen, the split product, and the recipe applying it."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import int8_model as quantize_int8_model
from batchgen.engine.quant import int8_siblings as quantize_int8_siblings
from batchgen.engine.quant import outliers as quantize_outliers
from batchgen.engine.quant import quantize
from batchgen.engine.quant import smooth as quantize_smooth
from tests.engine.greedy_pair import generate_and_engine_tokens
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not quantize_int8.supported("cpu"), reason="no oneDNN quantized ops or C compiler")
CALIBRATION = [[5 + (11 * i + j) % 250 for j in range(40)] for i in range(3)]


def test_the_channels_chosen_are_the_widest_the_quantizer_sees():
    ranges = torch.tensor([1.0, 50.0, 2.0, 9.0, 0.5, 30.0, 3.0, 1.0])
    assert quantize_outliers.outlier_channels(ranges, None, 0.0) is None
    assert quantize_outliers.outlier_channels(ranges, None, 0.25).tolist() == [1, 5]  # ceil(0.25 * 8) = 2, sorted
    assert quantize_outliers.outlier_channels(ranges, None, 0.01).tolist() == [1]  # at least one
    # with smoothing the quantizer reads x / s: channel 1 divided by 16 falls under channel 3
    smooth = torch.tensor([1.0, 16.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert quantize_outliers.outlier_channels(ranges, smooth, 0.25).tolist() == [3, 5]


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
    outliers = quantize_outliers.outlier_channels(x.float().abs().amax(0), None, 0.02)
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


def test_outliers_combine_with_smoothing():
    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 64, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 6, 96, dtype=torch.bfloat16)
    x[..., 3] *= 100
    x[..., 50] *= 8
    ranges = x.float().abs().reshape(-1, 96).amax(0)
    s = quantize_smooth.smoothing_factors(ranges, linear.weight, 0.5)
    outliers = quantize_outliers.outlier_channels(ranges, s, 0.01)
    layer = quantize_int8.Int8DynamicLinear(linear, s, outliers)
    assert layer.inv_smooth is not None and layer.colscale[outliers].eq(0).all()
    got = layer(x).double()
    exact = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    smoothed = quantize_int8.Int8DynamicLinear(linear, s)(x).double()
    assert got.shape == exact.shape
    assert (got - exact).norm() < (smoothed - exact).norm()
    assert torch.equal(layer.dequantized_weight()[:, outliers], linear.weight.float()[:, outliers])


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


def test_the_recipe_takes_outliers_where_it_says(monkeypatch):
    monkeypatch.setattr(quantize_int8_model, "INT8_OUTLIER_FRACTION", 0.05)
    monkeypatch.setattr(quantize_int8_model, "INT8_OUTLIER_LAYERS", ("down_proj",))
    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    names = quantize.quantizable_linear_names(model, 1)
    ranges = quantize_smooth.input_ranges(model, names, CALIBRATION)
    quantize.quantize_model(model, "int8", "onednn", embedding="none", calibration=CALIBRATION)
    layer = model.model.layers[0]
    down = layer.mlp.down_proj
    k = math.ceil(down.in_features * 5 / 100)
    assert down.outliers is not None and down.outliers.numel() == k
    seen = ranges["model.layers.0.mlp.down_proj"] * (1 if down.inv_smooth is None else down.inv_smooth)
    assert set(down.outliers.tolist()) == set(seen.topk(k).indices.tolist())
    assert layer.self_attn.o_proj.outliers is None and layer.mlp.gate_proj.group.linear.outliers is None
    # every layer
    monkeypatch.setattr(quantize_int8_model, "INT8_OUTLIER_LAYERS", ())
    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    quantize.quantize_model(model, "int8", "onednn", embedding="none", calibration=CALIBRATION)
    layer = model.model.layers[0]
    assert all(m.outliers is not None for m in (layer.self_attn.o_proj, layer.mlp.down_proj,
                                                layer.self_attn.q_proj.group.linear, layer.mlp.up_proj.group.linear))


def test_the_recipe_takes_per_layer_fractions(monkeypatch):
    monkeypatch.setattr(quantize_int8_model, "INT8_OUTLIER_FRACTION", 0.02)
    monkeypatch.setattr(quantize_int8_model, "INT8_OUTLIER_FRACTION_BY_LAYER", {"down_proj": 0.1, "up_proj": 0.0})
    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    down_weight = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    quantize.quantize_model(model, "int8", "onednn", embedding="none", calibration=CALIBRATION)
    layer = model.model.layers[0]
    down = layer.mlp.down_proj
    assert down.outliers.numel() == math.ceil(down.in_features * 0.1)
    o_proj = layer.self_attn.o_proj
    assert o_proj.outliers.numel() == math.ceil(o_proj.in_features * 0.02)
    assert layer.mlp.gate_proj.group.linear.outliers is None  # the stacked gate/up set goes by up_proj's 0
    assert down.outlier_weight.dtype == torch.bfloat16  # the bf16 model's dot-product layout
    assert torch.equal(down.outlier_rows(), down_weight[:, down.outliers].t().float())


# the outlier recipes measured in benchmarks/results/2026-12-02-int8-recipes.md: 5% with smoothing,
# and 3% with o_proj at 5%, no smoothing, down_proj asymmetric, the LM head in int8 without outliers
RECIPES = [{"INT8_OUTLIER_FRACTION": 0.05},
           {"INT8_OUTLIER_FRACTION": 0.03, "INT8_OUTLIER_FRACTION_BY_LAYER": {"o_proj": 0.05, "lm_head": 0.0},
            "INT8_SMOOTH_ALPHA": None, "INT8_ASYMMETRIC_LAYERS": ("down_proj",), "INT8_LM_HEAD": True}]


@pytest.mark.parametrize("recipe", RECIPES, ids=["o5-smoothed", "o3-by-layer-asym-head"])
def test_engine_greedy_equals_generate_with_outliers(monkeypatch, tokenizer, recipe):
    for switch, value in recipe.items():
        monkeypatch.setattr(quantize_int8_model, switch, value)
    model = make_tiny_model("llama", seed=6)  # float32: the engine's tokens equal generate's exactly
    quantize.quantize_model(model, "int8", "onednn", calibration=CALIBRATION)
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.outliers is not None
    if "INT8_ASYMMETRIC_LAYERS" in recipe:
        assert layer.mlp.down_proj.weight_colsum is not None and layer.self_attn.o_proj.inv_smooth is None
        assert layer.self_attn.o_proj.outliers.numel() == math.ceil(0.05 * layer.self_attn.o_proj.in_features)
        assert isinstance(model.lm_head, quantize_int8.Int8DynamicLinear) and model.lm_head.outliers is None
    refs, got = generate_and_engine_tokens(model, tokenizer)
    assert got == refs
