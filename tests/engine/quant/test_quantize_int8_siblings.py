"""q/k/v and gate/up as one stacked oneDNN int8 matmul (engine/quant/int8_siblings.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import int8_siblings as quantize_int8_siblings
from batchgen.engine.quant import quantize
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not quantize_int8.supported("cpu"), reason="no oneDNN quantized ops or C compiler")


def siblings(bias: bool) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(64, out, bias=bias).to(torch.bfloat16) for out in (64, 32, 32)]


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_outputs_equal_one_layer_each(bias):
    linears = siblings(bias)
    parent = torch.nn.Module()
    for name, lin in zip(("q_proj", "k_proj", "v_proj"), linears, strict=True):
        setattr(parent, name, lin)
    quantize_int8_siblings.stack(parent, ["q_proj", "k_proj", "v_proj"])
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = [parent.q_proj(x), parent.k_proj(x), parent.v_proj(x)]
        # per-row weights and per-token activations: stacking changes no operand
        want = [quantize_int8.Int8DynamicLinear(lin)(x) for lin in linears]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(parent.k_proj.dequantized_weight(),
                               quantize_int8.Int8DynamicLinear(linears[1]).dequantized_weight())


def test_any_call_order_and_a_new_input_give_the_right_columns():
    linears = siblings(False)
    group = quantize_int8_siblings.SiblingGroup(linears)
    layers = [quantize_int8_siblings.Int8SiblingLinear(group, i) for i in range(3)]
    singles = [quantize_int8.Int8DynamicLinear(lin) for lin in linears]
    a, b = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        for x, order in ((a, [1, 0, 2]), (b, [2, 2, 0]), (a, [0]), (b, [1])):  # repeats and switches
            for i in order:
                assert torch.equal(layers[i](x), singles[i](x)), (i, order)
        assert group._output is not None  # (b, [1]): two siblings still to serve keep the output
        layers[0](b), layers[2](b)
        assert group._output is None and group._input is None  # all served: references dropped


def test_quantize_model_stacks_each_layers_siblings_and_counts_bytes_once():
    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    quantize.quantize_model(model, "int8", "onednn", embedding="none")
    layer = model.model.layers[0]
    q, k, v = layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj
    assert all(isinstance(m, quantize_int8_siblings.Int8SiblingLinear) for m in (q, k, v))
    assert q.group is k.group is v.group and layer.mlp.gate_proj.group is layer.mlp.up_proj.group
    assert isinstance(layer.self_attn.o_proj, quantize_int8.Int8DynamicLinear)
    assert isinstance(layer.mlp.down_proj, quantize_int8.Int8DynamicLinear)
    packed = [m for m in model.modules() if isinstance(m, quantize_int8.Int8DynamicLinear)]
    assert len(packed) == 4 * len(model.model.layers)  # qkv, o, gate/up, down per layer


def test_gate_and_up_are_views_of_one_output_and_the_fused_mlp_reads_them():
    from batchgen.engine.kernels import fused, pointwise

    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    quantize.quantize_model(model, "int8", "onednn", embedding="none")
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 9, mlp.gate_proj.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        assert not gate.is_contiguous() and gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
        eager = mlp(x)  # transformers' forward on the views
        assert fused.fuse_pointwise(model) > 0 and getattr(mlp, "_batchgen_fused", False)
        kernels = pointwise.load_cached()
        copied = mlp.down_proj(kernels.silu_mul(gate.contiguous(), up.contiguous()))
        got = mlp(x)  # the fused kernel reading the views in place
        assert torch.equal(got, copied)
        torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)  # eager silu's exp vs the kernel's: ~1 ulp
