"""Linear layers on weights reordered once (engine/model/prepack.py): same results, same model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model import prepack
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import make_tiny_model

BF16 = torch.bfloat16
needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU's oneDNN has no bf16 kernels")


def bf16_model(seed: int = 0):
    return make_tiny_model("llama", seed=seed).to(BF16)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 7, prepack.SMALL_M_MAX, prepack.SMALL_M_MAX + 1, 700])
def test_packed_layer_matches_the_plain_one_on_both_sides_of_the_cutoff(bias, num_rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80, bias=bias).to(BF16)
    model = torch.nn.Sequential(layer)
    x = torch.randn(2, num_rows, 96, dtype=BF16)  # [batch, rows, features]: calls of 2 * num_rows rows
    expected = F.linear(x, layer.weight, layer.bias)
    assert prepack.pack_linear_layers(model, available_bytes=1 << 40) == 1
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == BF16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@needs_onednn_bf16
def test_packing_keeps_the_model_and_is_idempotent():
    model = bf16_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    num_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack.pack_linear_layers(model, available_bytes=1 << 40) == num_linear
    assert prepack.pack_linear_layers(model, available_bytes=1 << 40) == 0  # already packed
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if hasattr(m, "_batchgen_packed"))


@needs_onednn_bf16
def test_packed_model_logits_match_the_plain_model():
    ids = torch.randint(5, 200, (1, 40))
    plain = bf16_model(seed=3)
    packed = bf16_model(seed=3)
    assert prepack.pack_linear_layers(packed, available_bytes=1 << 40) > 0
    with torch.no_grad():
        a = plain(input_ids=ids).logits.float()
        b = packed(input_ids=ids).logits.float()
    torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("num_rows", [1, prepack.SMALL_M_MAX + 1, 700])
def test_float32_layers_use_the_reordered_weight_at_every_size(num_rows, monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80)
    x = torch.randn(2, num_rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    assert prepack.pack_linear_layers(torch.nn.Sequential(layer), available_bytes=1 << 40) == 1
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(prepack.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    got = layer(x)
    assert calls, "a float32 call of any size takes oneDNN's reordered weight"
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # float32 sums in another order


@needs_onednn_bf16
def test_no_copy_when_it_would_not_fit_in_memory():
    model = bf16_model()
    assert prepack.pack_linear_layers(model, available_bytes=1000) == 0
    assert not any(hasattr(m, "_batchgen_packed") for m in model.modules())


@needs_onednn_bf16
def test_engine_packs_a_bf16_model_unless_told_not_to(tokenizer):
    def generate(prepack_weights: bool) -> tuple[list[list[int]], bool]:
        model = bf16_model(seed=5)
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, prepack_weights=prepack_weights))
        requests = [Request(str(i), list(range(10 + i, 30 + 2 * i)), SamplingParams(max_new_tokens=6, ignore_eos=True))
                    for i in range(4)]
        out = {c.request_id: c.token_ids for c in engine.generate(requests)}
        return [out[str(i)] for i in range(4)], any(hasattr(m, "_batchgen_packed") for m in model.modules())

    packed_tokens, packed = generate(True)
    plain_tokens, plain = generate(False)
    assert packed and not plain
    assert all(len(t) == 6 for t in packed_tokens)
    # bf16 rounding may differ between the two kernels; the first token of most rows agrees
    assert sum(a[0] == b[0] for a, b in zip(packed_tokens, plain_tokens, strict=True)) >= 3
