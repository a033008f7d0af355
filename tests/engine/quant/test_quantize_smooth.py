"""SmoothQuant-style smoothing of the oneDNN int8 layers (engine/quant/smooth.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.kernels.fused import load_cached
from batchgen.engine.model import stream_load
from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import int8_model as quantize_int8_model
from batchgen.engine.quant import quantize
from batchgen.engine.quant import smooth as quantize_smooth
from tests.engine.greedy_pair import generate_and_engine_tokens
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not quantize_int8.supported("cpu"), reason="no oneDNN quantized ops or C compiler")
CALIBRATION = [[5 + (11 * i + j) % 250 for j in range(40)] for i in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_quantizer_equals_quantizing_the_float32_product(dtype):
    x = torch.randn(9, 100, dtype=dtype)
    colscale = torch.exp2(torch.randint(-6, 6, (100,)).float()) * torch.rand(100).add(0.5)
    q, scale = load_cached().quantize_rows_u8_scaled(x, colscale)
    q_want, scale_want = load_cached().quantize_rows_u8((x.float() * colscale).contiguous())
    assert torch.equal(q, q_want) and torch.equal(scale, scale_want)


def test_factors_are_powers_of_two_near_the_smoothquant_formula():
    amax = torch.tensor([0.0, 1.0, 100.0, 3.0])
    weight = torch.tensor([[0.5, -1.0, 0.01, 2.0], [0.1, 0.2, -0.02, 0.3]])
    s = quantize_smooth.smoothing_factors(amax, weight, 0.5)
    exact = (amax.clamp(min=1e-5).sqrt() / weight.abs().amax(0).sqrt())
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    assert ((s / exact).log2().abs() <= 0.5 + 1e-6).all()  # the nearest ones
    assert s[2] > 32 * s[1]  # the outlier channel moves the most range into the weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smoothed_linear_equals_its_int8_reference(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 64, bias=False).to(dtype)
    x = torch.randn(11, 96, dtype=dtype)
    x[:, 7] *= 80  # an outlier channel, as decoder inputs have
    s = quantize_smooth.smoothing_factors(x.float().abs().amax(0), linear.weight, 0.5)
    layer = quantize_int8.Int8DynamicLinear(linear, s)
    got = layer(x).double()
    # the reference: x / s per token and W * s per output row, each symmetric int8, in float64
    xs = x.double() / s.double()
    x_scale = xs.abs().amax(1, keepdim=True) / 127
    qx = (xs / x_scale).round().clamp(-127, 127)
    ws = linear.weight.float() * s  # the weight is quantized in float32, as quantize_rows does
    w_scale = ws.abs().amax(1, keepdim=True) / 127
    qw = (ws / w_scale).round().clamp(-127, 127)
    w_scale, qw = w_scale.double(), qw.double()
    want = (qx @ qw.T) * x_scale * w_scale.T
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * want.abs().max()
    torch.testing.assert_close(layer.dequantized_weight().double(), qw * w_scale / s.double(), rtol=1e-5, atol=1e-6)
    # and smoothing is what brings it near the float layer: the unsmoothed layer loses the
    # other channels to the outlier's range
    exact = x.double() @ linear.weight.double().T
    plain = quantize_int8.Int8DynamicLinear(linear)(x).double()
    assert (got - exact).norm() < 0.5 * (plain - exact).norm()


def test_quantize_model_calibrates_and_labels_the_smoothing(monkeypatch):
    monkeypatch.setattr(quantize_int8_model, "INT8_SMOOTH_ALPHA", 0.5)  # a recipe that smooths
    model = make_tiny_model("llama", seed=5)
    names = quantize.quantizable_linear_names(model, 1)
    ranges = quantize_smooth.input_ranges(model, names, CALIBRATION)
    assert ranges.keys() == names and all(r.shape == (model.get_submodule(n).in_features,) for n, r in ranges.items())
    applied = quantize.quantize_model(model, "int8", "onednn", embedding="none", calibration=CALIBRATION)
    assert applied.label == "int8/onednn+calibrated" and applied.calibrated_run
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, quantize_int8.Int8DynamicLinear) and down.inv_smooth is not None
    want = 1 / quantize_smooth.smoothing_factors(ranges["model.layers.0.mlp.down_proj"],
                                                 make_tiny_model("llama", seed=5).model.layers[0].mlp.down_proj.weight,
                                                 0.5)
    assert torch.equal(down.inv_smooth, want)
    # no calibration tokens: unsmoothed, and the label says so
    plain = make_tiny_model("llama", seed=5)
    assert quantize.quantize_model(plain, "int8", "onednn", embedding="none").label == "int8/onednn"
    assert plain.model.layers[0].mlp.down_proj.inv_smooth is None


def test_engine_greedy_equals_generate_of_the_smoothed_model(tokenizer):
    model = make_tiny_model("llama", seed=6)  # float32: the engine's tokens equal generate's exactly
    quantize.quantize_model(model, "int8", "onednn", calibration=CALIBRATION)
    refs, got = generate_and_engine_tokens(model, tokenizer)
    assert got == refs


def test_calibration_ids_use_the_chat_template(tokenizer):
    ids = quantize_smooth.calibration_ids(tokenizer)
    assert len(ids) == len(quantize_smooth.CALIBRATION_PROMPTS) and all(len(i) > 10 for i in ids)


def test_the_streaming_loader_leaves_a_calibrated_scheme_to_the_full_model(tmp_path, tokenizer):
    model = make_tiny_model("llama", seed=7)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert stream_load.load_quantized("tiny", str(tmp_path), torch.bfloat16, "int8", "onednn", "none") is None


def test_load_model_calibrates_on_the_whole_full_precision_model(tiny_model_dir):
    from batchgen.engine.model.loader import load_model

    lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", quantize="int8", quantize_backend="onednn")
    assert lm.quantization == "int8/onednn+calibrated"
    down = lm.model.model.layers[0].mlp.down_proj
    assert down.outliers is not None or down.inv_smooth is not None  # the recipe's calibrated parts
