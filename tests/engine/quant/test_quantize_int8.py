"""int8 x int8 linear layers on oneDNN (engine/quant/int8.py, --quantize int8 --quantize-backend onednn)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.kernels.pointwise import load_cached
from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import quantize
from tests.engine.greedy_pair import generate_and_engine_tokens
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not quantize_int8.supported("cpu"), reason="no oneDNN quantized ops or C compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantizer_matches_the_eager_formula(dtype):
    x = torch.randn(37, 100, dtype=dtype) * torch.linspace(0.01, 10, 37)[:, None].to(dtype)
    x[3] = 0  # a zero row: scale 1, zeros
    q, scale = load_cached().quantize_rows_s8(x)
    amax = x.float().abs().amax(1, keepdim=True)
    want_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    torch.testing.assert_close(scale, want_scale)
    want = (x.float() * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).round().clamp(-127, 127)
    assert (q.float() - want).abs().max() <= 1  # x * (127 / amax) may round the other way at a .5 tie
    assert (q.float() - want).abs().gt(0).float().mean() < 0.01
    assert q[3].eq(0).all() and scale[3].item() == 1.0
    # the uint8 form oneDNN's VNNI kernel takes: the same values + 128 (zero point 128)
    q_u8, scale_u8 = load_cached().quantize_rows_u8(x)
    assert q_u8.dtype == torch.uint8 and torch.equal(scale_u8, scale)
    assert torch.equal(q_u8.int() - quantize_int8.ZERO_POINT, q.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_quantizer_equals_quantizing_the_float32_product(dtype):
    x = torch.randn(9, 100, dtype=dtype)
    colscale = torch.exp2(torch.randint(-6, 6, (100,)).float()) * torch.rand(100).add(0.5)
    colscale[[3, 40]] = 0  # outlier channels: read as 0
    q, scale = load_cached().quantize_rows_u8_scaled(x, colscale)
    q_want, scale_want = load_cached().quantize_rows_u8((x.float() * colscale).contiguous())
    assert torch.equal(q, q_want) and torch.equal(scale, scale_want)
    assert q[:, [3, 40]].eq(quantize_int8.ZERO_POINT).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_its_int8_reference(dtype, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias).to(dtype)
    layer = quantize_int8.Int8DynamicLinear(linear)
    x = torch.randn(2, 7, 96, dtype=dtype)
    got = layer(x)
    assert got.shape == (2, 7, 160) and got.dtype == dtype
    # the reference: the same int8 operands multiplied in float64
    flat = x.reshape(-1, 96).double()
    x_scale = flat.abs().amax(1, keepdim=True) / 127
    qx = (flat / x_scale).round().clamp(-127, 127)
    w = linear.weight.float()  # the weight is quantized in float32, as quantize_rows does
    w_scale = w.abs().amax(1, keepdim=True) / 127
    qw = (w / w_scale).round().clamp(-127, 127)
    w_scale, qw = w_scale.double(), qw.double()
    want = (qx @ qw.T) * x_scale * w_scale.T
    if bias:
        want = want + linear.bias.double()
    want = want.reshape(2, 7, 160)
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max() <= tol * want.abs().max()
    # and it stays near the float layer
    assert (got.double() - linear(x).double()).abs().max() <= 0.05 * want.abs().max()
    torch.testing.assert_close(layer.dequantized_weight(), (qw * w_scale).float(), rtol=1e-5, atol=1e-6)


def test_quantize_model_swaps_every_decoder_linear_and_counts_the_packed_bytes():
    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    before = quantize.weight_bytes(model)
    applied = quantize.quantize_model(model, "int8", "onednn", embedding="none")
    assert applied.label == "int8/onednn"
    layer = model.model.layers[0]
    assert all(isinstance(m, quantize_int8.Int8DynamicLinear) for m in (layer.self_attn.o_proj, layer.mlp.down_proj))
    # q/k/v: one stacked matmul (engine/quant/int8_siblings.py)
    assert layer.self_attn.q_proj.group.linear.out_features == sum(
        getattr(layer.self_attn, n).out_features for n in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert quantize.weight_bytes(model) < before
    # the recipe's asymmetric activations: down_proj only (engine/quant/recipe.py)
    assert layer.mlp.down_proj.weight_colsum is not None and layer.mlp.up_proj.group.linear.weight_colsum is None
    assert layer.self_attn.o_proj.weight_colsum is None and layer.self_attn.q_proj.group.linear.weight_colsum is None


def test_engine_greedy_equals_generate_of_the_same_model(tokenizer):
    model = make_tiny_model("llama", seed=6)  # float32: the engine's tokens equal generate's exactly
    quantize.quantize_model(model, "int8", "onednn")
    refs, got = generate_and_engine_tokens(model, tokenizer)
    assert got == refs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_quantizer_matches_its_formula(dtype):
    x = torch.randn(21, 100, dtype=dtype).abs() * 3 - 0.5  # leaning positive
    x[4] = 0  # a zero row: scale 1, zero point 0
    x[5] = -x[5].abs()  # all negative: zero point 255
    colscale = torch.rand(100) + 0.5
    q, scale, zero = load_cached().quantize_rows_u8_asym(x, colscale)
    v = x.float() * colscale
    hi, lo = v.amax(1).clamp(min=0), v.amin(1).clamp(max=0)
    want_scale = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(hi))
    torch.testing.assert_close(scale, want_scale)
    want_zero = (-lo / want_scale).round().clamp(0, 255)
    assert torch.equal(zero, want_zero)
    want = ((v / want_scale[:, None]).round() + want_zero[:, None]).clamp(0, 255)
    assert (q.float() - want).abs().max() <= 1 and (q.float() - want).abs().gt(0).float().mean() < 0.01
    assert q[4].eq(0).all() and zero[4] == 0 and zero[5] == 255
    # dequantized, each value is within half a step of its input
    assert ((q.float() - zero[:, None]) * scale[:, None] - v).abs().max(1).values.le(scale * 0.51).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_linear_equals_its_reference_and_beats_symmetric_on_one_sided_inputs(dtype):
    torch.manual_seed(3)
    linear = torch.nn.Linear(96, 80, bias=True).to(dtype)
    x = (torch.randn(13, 96) * 0.3 + torch.rand(13, 96) * 2).to(dtype)  # mostly positive, as SiLU(gate) * up leans
    layer = quantize_int8.Int8DynamicLinear(linear, asymmetric=True)
    got = layer(x).double()
    v = x.double()
    hi, lo = v.amax(1, keepdim=True).clamp(min=0), v.amin(1, keepdim=True).clamp(max=0)
    s = (hi - lo) / 255
    zp = (-lo / s).round()
    qx = ((v / s).round() + zp).clamp(0, 255) - zp
    w = linear.weight.float()
    w_scale = w.abs().amax(1, keepdim=True) / 127
    qw = (w / w_scale).round().clamp(-127, 127).double() * w_scale.double()
    want = (qx * s) @ qw.T + linear.bias.double()
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    assert (got - want).abs().max() <= tol * want.abs().max()
    # the activations' share of the error: against the same int8 weight in float64
    exact = torch.nn.functional.linear(v, layer.dequantized_weight().double(), linear.bias.double())
    symmetric = quantize_int8.Int8DynamicLinear(linear)(x).double()
    assert (got - exact).norm() < 0.8 * (symmetric - exact).norm()

