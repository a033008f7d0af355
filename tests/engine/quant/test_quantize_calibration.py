"""The calibration pass of the oneDNN int8 recipe (engine/quant/calibration.py): the input ranges
it measures, the outlier channels taken from them, and where it runs."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.model import stream_load
from batchgen.engine.quant import calibration as quantize_calibration
from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import outliers as quantize_outliers
from batchgen.engine.quant import quantize
from batchgen.engine.quant.recipe import INT8_OUTLIER_FRACTION
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not quantize_int8.supported("cpu"), reason="no oneDNN quantized ops or C compiler")
CALIBRATION = [[5 + (11 * i + j) % 250 for j in range(40)] for i in range(3)]


def test_quantize_model_calibrates_and_labels_it():
    model = make_tiny_model("llama", seed=5)
    names = quantize.quantizable_linear_names(model, 1)
    ranges = quantize_calibration.input_ranges(model, names, CALIBRATION)
    assert ranges.keys() == names and all(r.shape == (model.get_submodule(n).in_features,) for n, r in ranges.items())
    applied = quantize.quantize_model(model, "int8", "onednn", embedding="none", calibration=CALIBRATION)
    assert applied.label == "int8/onednn+calibrated" and applied.calibrated_run
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, quantize_int8.Int8DynamicLinear)
    want = quantize_outliers.outlier_channels(ranges["model.layers.0.mlp.down_proj"], INT8_OUTLIER_FRACTION)
    assert torch.equal(down.outliers, want)
    # no calibration tokens: no outlier channels, and the label says so
    plain = make_tiny_model("llama", seed=5)
    assert quantize.quantize_model(plain, "int8", "onednn", embedding="none").label == "int8/onednn"
    assert plain.model.layers[0].mlp.down_proj.outliers is None


def test_calibration_ids_use_the_chat_template(tokenizer):
    ids = quantize_calibration.calibration_ids(tokenizer)
    assert len(ids) == len(quantize_calibration.CALIBRATION_PROMPTS) and all(len(i) > 10 for i in ids)


def test_the_streaming_loader_leaves_a_calibrated_scheme_to_the_full_model(tmp_path, tokenizer):
    model = make_tiny_model("llama", seed=7)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert stream_load.load_quantized("tiny", str(tmp_path), torch.bfloat16, "int8", "onednn", "none") is None


def test_load_model_calibrates_on_the_whole_full_precision_model(tiny_model_dir):
    from batchgen.engine.model.loader import load_model

    lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", quantize="int8", quantize_backend="onednn")
    assert lm.quantization == "int8/onednn+calibrated"
    assert lm.model.model.layers[0].mlp.down_proj.outliers is not None  # the recipe's calibrated part
