"""What the quantization flags resolve to before any weight is touched (engine/quant/plan.py):
auto's backend per device and scheme, the refusals, the embedding, the GGUF mapping, the label."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import plan as quantize_plan
from batchgen.engine.quant.checkpoint import gguf_scheme
from batchgen.engine.quant.plan import Quantization
from batchgen.errors import ConfigError

# resolve_backend refuses a torchao/quanto backend whose package is not installed
needs_quant_packages = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None or importlib.util.find_spec("optimum") is None
    or importlib.util.find_spec("optimum.quanto") is None, reason="needs torchao and optimum-quanto")


@needs_quant_packages
def test_auto_backend_and_refusals(monkeypatch):
    cpu = torch.device("cpu")
    assert quantize_plan.resolve_backend("none", "auto", cpu) is None
    # int8: oneDNN's matmul where the CPU has VNNI or AMX (and torch has the ops), else torchao
    monkeypatch.setattr(quantize_int8, "cpu_has_int8_matmul", lambda: False)
    assert quantize_plan.resolve_backend("int8", "auto", cpu) == "torchao"
    monkeypatch.setattr(quantize_int8, "cpu_has_int8_matmul", lambda: True)
    want = "onednn" if quantize_int8.supported("cpu") else "torchao"
    assert quantize_plan.resolve_backend("int8", "auto", cpu) == want
    assert quantize_plan.resolve_backend("int8", "auto", torch.device("cuda")) == "torchao"
    assert quantize_plan.resolve_backend("int8-weight", "auto", cpu) == \
        quantize_plan.AUTO_BACKEND[("cpu", "int8-weight")]
    with pytest.raises(ConfigError, match="torchao only"):
        quantize_plan.resolve_backend("int8", "quanto", cpu)
    with pytest.raises(ConfigError, match="quantize must be"):
        quantize_plan.resolve_backend("int2", "auto", cpu)
    with pytest.raises(ConfigError, match="quantize_backend"):
        quantize_plan.resolve_backend("int8", "bitsandbytes", cpu)


@pytest.mark.skipif(not quantize_int8.supported("cpu"), reason="no oneDNN quantized ops or C compiler")
def test_onednn_backend_refusals():
    cpu = torch.device("cpu")
    assert quantize_plan.resolve_backend("int8", "onednn", cpu) == "onednn"
    for scheme in ("int8-weight", "int4"):
        with pytest.raises(ConfigError, match="onednn"):
            quantize_plan.resolve_backend(scheme, "onednn", cpu)
    with pytest.raises(ConfigError, match="CPU only"):
        quantize_plan.resolve_backend("int8", "onednn", torch.device("cuda"))


def test_auto_quantizes_the_embedding_for_int4_only():
    assert quantize_plan.resolve_embedding("auto", "int4") == "int8"
    assert quantize_plan.resolve_embedding("auto", "int8-weight") == "none"
    assert quantize_plan.resolve_embedding("none", "int4") == "none"
    assert quantize_plan.resolve_embedding("int8", "none") == "int8"
    with pytest.raises(ConfigError, match="quantize_embedding"):
        quantize_plan.resolve_embedding("int4", "int4")


@pytest.mark.parametrize(("name", "scheme"), [("SmolLM2-135M-Instruct.Q4_1.gguf", "int4"),
                                              ("m-Q8_0.gguf", "int8-weight"), ("m.IQ3_XS.gguf", "int4"),
                                              ("m.Q6_K.gguf", "int8-weight")])
def test_gguf_quantization_maps_to_the_nearest_scheme(name, scheme):
    assert gguf_scheme(name) == scheme
    assert quantize_plan.requested_scheme("auto", "m", name) == scheme  # --quantize auto takes it
    assert quantize_plan.requested_scheme("none", "m", name) == "none"  # an explicit none stays none
    assert quantize_plan.requested_scheme("auto", "m") == "none"  # not a GGUF: nothing to map


@needs_quant_packages
def test_plan_refuses_to_quantize_a_prequantized_config_but_lets_none_through():
    cpu = torch.device("cpu")
    prequantized = SimpleNamespace(quantization_config={"quant_method": "torchao"})
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_plan.plan_quantization(prequantized, "int4", "auto", "auto", cpu)
    assert quantize_plan.plan_quantization(prequantized, "none", "auto", "none", cpu) == Quantization("none", None)
    assert quantize_plan.plan_quantization(SimpleNamespace(), "int4", "torchao", "auto", cpu) == \
        Quantization("int4", "torchao", "int8")


def test_label_names_scheme_backend_calibration_and_embedding():
    assert Quantization("none", None).label == "none"
    assert Quantization("int4", "torchao", "int8").label == "int4/torchao+int8-embedding"
    assert Quantization("int8", "onednn", calibrated_run=True).label == "int8/onednn+calibrated"
    assert not Quantization("int4", "torchao").calibrated  # only int8/onednn's recipe calibrates
