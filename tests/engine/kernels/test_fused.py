"""Fused CPU pointwise kernels (engine/kernels/fused.py, engine/kernels/pointwise.py, csrc/pointwise.c):
the eager ops' results, the same model, and only on modules whose forward they reproduce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.kernels import fused, pointwise
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import make_tiny_model

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernels() -> pointwise.PointwiseKernels:
    k = pointwise.load()
    assert k is not None, "the kernels must build where a C compiler is present (CI has gcc)"
    return k


def eager_rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 7, 576), (3, 5, 40), (1, 300, 576)])  # 300 x 576: threaded
def test_rms_norm_rounds_where_the_eager_norm_rounds(kernels, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 4).to(BF16)
    x[..., 0] = 0
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(BF16)
    got, expected = kernels.rms_norm(x, weight, 1e-5), eager_rms_norm(x, weight, 1e-5)
    assert got.dtype == BF16 and got.shape == x.shape
    # only the order of the f32 sum of squares differs: at most one bf16 step, on a rare element
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-6)
    assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("numel", [1, 33, 4096 * 3 + 5, 70_000])  # 70k elements: threaded
def test_silu_mul_equals_the_eager_activation(kernels, numel):
    gen = torch.Generator().manual_seed(numel)
    gate = (torch.randn(numel, generator=gen) * 6).to(BF16)
    gate[:1] = -200.0  # exp(-gate) overflows f32: silu is -0, not NaN
    up = torch.randn(numel, generator=gen).to(BF16)
    got, expected = kernels.silu_mul(gate, up), F.silu(gate) * up
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-30)
    assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 50])  # 50 x 1536: threaded
def test_silu_mul_reads_the_halves_of_a_stacked_output_in_place(kernels, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    stacked = (torch.randn(1, rows, 2 * 1536, generator=gen) * 4).to(dtype)  # [gate | up] per row
    gate, up = stacked[..., :1536], stacked[..., 1536:]
    assert pointwise.rows_view(gate) is not None and (rows == 1 or not gate.is_contiguous())
    got = kernels.silu_mul(gate, up)
    assert got.is_contiguous() and got.shape == gate.shape
    assert torch.equal(got, kernels.silu_mul(gate.contiguous(), up.contiguous()))  # the same bits as contiguous
    assert pointwise.rows_view(stacked.transpose(1, 2)) is None  # columns not unit-strided: the eager ops take it


def test_fuses_norms_and_mlps_of_a_bf16_llama_and_keeps_its_logits():
    model = make_tiny_model("llama", seed=3).to(BF16)
    ids = torch.randint(3, 200, (1, 37))
    with torch.inference_mode():
        expected = model(ids).logits
    layers = model.config.num_hidden_layers
    assert fused.fuse_pointwise(model) == 2 * layers + 1 + layers  # 2 norms a layer, the final norm, MLPs
    assert fused.fuse_pointwise(model) == 3 * layers + 1, "idempotent"
    with torch.inference_mode():
        got = model(ids).logits
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert sorted(model.state_dict()) == sorted(make_tiny_model("llama", seed=3).state_dict())


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_copies_of_the_llama_modules_are_fused_too(arch):
    model = make_tiny_model(arch).to(BF16)
    assert fused.fuse_pointwise(model) == 3 * model.config.num_hidden_layers + 1


def test_float32_models_are_fused_and_other_forwards_left_alone():
    model = make_tiny_model("llama")  # float32
    assert fused.fuse_pointwise(model) == 3 * model.config.num_hidden_layers + 1

    class ShiftedNorm(LlamaRMSNorm):  # same attributes, another computation (Gemma's 1 + weight, say)
        def forward(self, hidden_states):
            return super().forward(hidden_states) + hidden_states

    model = torch.nn.Sequential(ShiftedNorm(16).to(BF16))
    assert fused.fuse_pointwise(model) == 0
    assert "forward" not in vars(model[0])


def test_autograd_runs_the_original_forward():
    model = make_tiny_model("llama", seed=1).to(BF16)
    fused.fuse_pointwise(model)
    loss = model(torch.randint(3, 200, (1, 9))).logits.float().sum()
    loss.backward()  # the fused kernels have no backward; with grad enabled the eager ops run
    assert model.model.norm.weight.grad is not None


def test_engine_fuses_a_bf16_model_unless_told_not_to(tokenizer):
    def generate(fuse: bool) -> tuple[list[list[int]], bool]:
        model = make_tiny_model("llama", seed=5).to(BF16)
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, fuse_pointwise=fuse))
        requests = [Request(str(i), list(range(10 + i, 30 + 2 * i)), SamplingParams(max_new_tokens=6, ignore_eos=True))
                    for i in range(4)]
        out = {c.request_id: c.token_ids for c in engine.generate(requests)}
        return [out[str(i)] for i in range(4)], any(getattr(m, "_batchgen_fused", False) for m in model.modules())

    fused_tokens, was_fused = generate(True)
    plain_tokens, was_plain = generate(False)
    assert was_fused and not was_plain
    assert fused_tokens == plain_tokens  # the kernels round as the eager ops do


def token_major(B, T, heads, D, gen):
    """q/k as transformers' attention forward makes them: a [B, heads, T, D] view of [B, T, heads, D]."""
    return (torch.randn(B, T, heads * D, generator=gen) * 3).to(BF16).view(B, T, heads, D).transpose(1, 2)


@pytest.mark.parametrize("shape", [(1, 1, 9, 3, 64), (2, 1, 4, 1, 64), (3, 7, 4, 2, 128), (1, 5, 2, 2, 48),
                                   (1, 600, 9, 3, 64)])  # B, T, H, KVH, D; 600 tokens: threaded
def test_rope_gives_the_eager_bits(kernels, shape):
    from transformers.models.llama.modeling_llama import rotate_half

    B, T, H, KVH, D = shape
    gen = torch.Generator().manual_seed(T * D)
    q, k = token_major(B, T, H, D, gen), token_major(B, T, KVH, D, gen)
    angles = torch.randn(B, T, D, generator=gen) * 10
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    with torch.inference_mode():
        got_q, got_k = kernels.rope(q, k, cos, sin)
    # transformers' eager apply_rotary_pos_emb, spelled out
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    torch.testing.assert_close(got_q, q * c + rotate_half(q) * s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, k * c + rotate_half(k) * s, rtol=1e-6, atol=1e-6)


def test_rope_is_replaced_in_the_modeling_module_and_runs_only_inside_an_engine_forward(kernels, tokenizer,
                                                                                       monkeypatch):
    from transformers.models.llama import modeling_llama

    model = make_tiny_model("llama", seed=7).to(BF16)
    fused.fuse_pointwise(model)
    replacement = modeling_llama.apply_rotary_pos_emb
    original = replacement._batchgen_original
    assert fused.fuse_rope(model, kernels) == [], "idempotent"
    calls = []
    real_rope = pointwise.PointwiseKernels.rope
    monkeypatch.setattr(pointwise.PointwiseKernels, "rope", lambda self, *a: calls.append(1) or real_rope(self, *a))

    gen = torch.Generator().manual_seed(0)
    q, k = token_major(1, 4, 4, 16, gen), token_major(1, 4, 2, 16, gen)
    cos, sin = torch.ones(1, 4, 16).to(BF16), torch.zeros(1, 4, 16).to(BF16)
    with torch.inference_mode():
        pairs = zip(replacement(q, k, cos, sin), original(q, k, cos, sin), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        model(torch.randint(3, 200, (1, 9)))
    assert not calls, "outside an engine's forward the original runs"

    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    list(engine.generate([Request("a", list(range(10, 30)), SamplingParams(max_new_tokens=3, ignore_eos=True))]))
    assert len(calls) == 3 * model.config.num_hidden_layers  # each step, each layer


def test_other_rotary_functions_are_left_alone(kernels):
    import types as pytypes

    fake = pytypes.ModuleType("fake_modeling")
    fake.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)  # another computation
    fake.rotate_half = lambda x: x

    class Attention(torch.nn.Module):
        pass

    Attention.__module__ = "fake_modeling"
    import sys

    sys.modules["fake_modeling"] = fake
    try:
        assert fused.fuse_rope(torch.nn.Sequential(Attention()), kernels) == []
        assert not hasattr(fake.apply_rotary_pos_emb, "_batchgen_original")
    finally:
        del sys.modules["fake_modeling"]


def test_float32_kernels_match_the_eager_ops(kernels):
    """float32: the norm sums in another order, the SiLU's exp is a polynomial and the compiler may
    contract rope's products and sums into FMAs: ~1 ulp each."""
    from transformers.models.llama.modeling_llama import rotate_half

    gen = torch.Generator().manual_seed(32)
    x = torch.randn(1, 300, 576, generator=gen) * 4
    weight = torch.rand(576, generator=gen) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), eager_rms_norm(x, weight, 1e-5),
                               rtol=1e-6, atol=1e-6)
    gate, up = torch.randn(70_000, generator=gen) * 6, torch.randn(70_000, generator=gen)
    gate[:1] = -200.0
    torch.testing.assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up, rtol=1e-6, atol=1e-30)
    q = (torch.randn(1, 7, 9 * 64, generator=gen) * 3).view(1, 7, 9, 64).transpose(1, 2)
    k = (torch.randn(1, 7, 3 * 64, generator=gen) * 3).view(1, 7, 3, 64).transpose(1, 2)
    angles = torch.randn(1, 7, 64, generator=gen) * 10
    cos, sin = angles.cos(), angles.sin()
    with torch.inference_mode():
        got_q, got_k = kernels.rope(q, k, cos, sin)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    torch.testing.assert_close(got_q, q * c + rotate_half(q) * s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, k * c + rotate_half(k) * s, rtol=1e-6, atol=1e-6)
