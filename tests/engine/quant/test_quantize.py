"""Weight quantization (engine/quant/quantize.py): every scheme and backend on a tiny random model.

Each quantized model is compared with its own dequantized reference (the same model with every
quantized weight replaced by the dense weight it stands for), and run through the engine, whose
greedy tokens must equal the quantized model's own `generate`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.engine.quant import quantize
from batchgen.engine.quant.plan import Quantization
from tests.engine.greedy_pair import generate_and_engine_tokens
from tests.tiny import make_tiny_model

pytest.importorskip("torchao")
pytest.importorskip("optimum.quanto")

CASES = [("int8", "torchao"), ("int8-weight", "torchao"), ("int8-weight", "quanto"), ("int4", "torchao"),
         ("int4", "quanto")]
# dynamic int8 activations add their own rounding; the weight-only schemes only the kernels'
TOLERANCE = {"int8": 0.08, "int8-weight": 0.02, "int4": 0.02}


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return weight
    try:
        return weight.dequantize()
    except NotImplementedError:  # torchao's opaque CPU int4 packing: read it back through its own kernel
        eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
        return torch.nn.functional.linear(eye, weight).T


def dequantized_reference(qmodel: torch.nn.Module, original: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(original)
    modules = dict(qmodel.named_modules())
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dense_weight(modules[name].weight).to(module.weight.dtype))
    return ref


@pytest.mark.parametrize(("scheme", "backend"), CASES)
def test_forward_equals_its_dequantized_reference(scheme, backend):
    model = make_tiny_model("llama", seed=5).to(torch.bfloat16)
    original = copy.deepcopy(model)
    applied = quantize.quantize_model(model, scheme, backend, embedding="none")
    assert applied == Quantization(scheme, backend)
    down = model.model.layers[0].mlp.down_proj.weight
    assert type(down) not in (torch.Tensor, torch.nn.Parameter), "the decoder's linear layers are quantized"
    assert type(model.lm_head.weight) in (torch.Tensor, torch.nn.Parameter), "the LM head stays dense"
    ref = dequantized_reference(model, original)
    for (name, q), (_, w) in zip(ref.named_parameters(), original.named_parameters(), strict=True):
        bits = 4 if scheme == "int4" else 8  # the dense weights stay near the originals
        assert (q.float() - w.float()).abs().max() <= 2.0 ** (2 - bits) * w.float().abs().max(), name
    ids = torch.randint(5, 261, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    assert (got - want).abs().max() <= TOLERANCE[scheme] * want.abs().max()
    assert quantize.weight_bytes(model) < quantize.weight_bytes(original)


@pytest.mark.parametrize(("scheme", "backend", "dtype"),
                         [("int8", "torchao", torch.float32), ("int8-weight", "torchao", torch.float32),
                          ("int8-weight", "quanto", torch.float32), ("int4", "torchao", torch.bfloat16),
                          ("int4", "quanto", torch.float32)])
def test_engine_greedy_equals_generate_of_the_same_quantized_model(tokenizer, scheme, backend, dtype):
    model = make_tiny_model("llama", seed=6).to(dtype)
    quantize.quantize_model(model, scheme, backend)
    refs, got = generate_and_engine_tokens(model, tokenizer)
    if dtype == torch.float32:
        assert got == refs
    else:  # bf16: packed vs unpacked rows may round differently; the first tokens must agree
        assert [g[:2] for g in got] == [r[:2] for r in refs]


def test_tied_lm_head_stays_tied():
    model = make_tiny_model("llama", seed=2)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    quantize.quantize_model(model, "int8-weight", "torchao")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_auto_quantizes_a_quantized_gguf_and_leaves_other_models_alone():
    model = make_tiny_model("llama", seed=1).to(torch.bfloat16)
    assert quantize.apply_at_load(copy.deepcopy(model), "tiny", "auto", "auto") == "none"
    assert quantize.apply_at_load(model, "tiny.Q4_0.gguf", "auto", "auto", "tiny.Q4_0.gguf") == \
        "int4/torchao+int8-embedding"


@pytest.mark.parametrize("backend", ["torchao", "quanto"])
def test_int4_recipe_group_sizes(backend):
    assert quantize.INT4_COARSE_LAYERS == ("gate_proj",)  # the default recipe (engine/quant/recipe.py)
    model = make_tiny_model("llama", seed=3).to(torch.bfloat16)
    quantize.quantize_model(model, "int4", backend, embedding="none")
    layer = model.model.layers[1]
    for module, want in [(layer.mlp.gate_proj, quantize.INT4_COARSE_GROUP_SIZE),
                         (layer.mlp.up_proj, quantize.INT4_GROUP_SIZE), (layer.mlp.down_proj, quantize.INT4_GROUP_SIZE),
                         (layer.self_attn.q_proj, quantize.INT4_GROUP_SIZE)]:
        got = module.weight.block_size[-1] if backend == "torchao" else module.weight_group_size
        assert got == want, (module, got)


def test_int4_reproduces_weights_already_on_a_q4_1_grid():
    """A GGUF Q4_1 checkpoint (the embedded model's) stores each block of 32 weights as q * d + m,
    q in 0..15: groups of 32 with min/max parameters land every weight back on its grid point, up to
    the bf16 rounding of the weights and of the group's scale and zero (well under half a step)."""
    model = make_tiny_model("llama", seed=4).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                q = torch.randint(0, 16, (*w.shape[:-1], w.shape[-1] // 32, 32), generator=gen).float()
                q[..., 0], q[..., 1] = 0, 15  # each block spans its whole range, as Q4_1's quantizer makes it
                d = torch.rand(*q.shape[:-1], 1, generator=gen) * 0.01 + 0.001
                m = -d * 7.5 + torch.randn(*q.shape[:-1], 1, generator=gen) * 0.001
                w.copy_((q * d + m).reshape(w.shape))
    original = copy.deepcopy(model)
    quantize.quantize_model(model, "int4", "torchao", embedding="none")
    for (name, module), (_, orig) in zip(model.model.layers.named_modules(), original.model.layers.named_modules(),
                                         strict=True):
        if isinstance(orig, torch.nn.Linear) and not name.endswith(quantize.INT4_COARSE_LAYERS):
            w = orig.weight.float()
            step = (w.reshape(-1, 32).amax(1) - w.reshape(-1, 32).amin(1)) / 15
            err = (dense_weight(module.weight).float() - w).reshape(-1, 32).abs().amax(1)
            assert (err <= 0.2 * step).all(), (name, (err / step).max())
