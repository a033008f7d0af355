"""The grouped MoE pass (engine/model/experts.py) computes what each family's HF expert loop computes,
and is chosen per class only where it does. Greedy tokens through the engine with it on:
tests/engine/test_families_generate.py. By default it runs in bf16 only; its code is the same in
every dtype, so these tests run it in float32 too, where equality is strict."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from batchgen.engine.model import experts, prepack
from tests.engine.test_families_generate import SHIPPED, build

MOE_FAMILIES = [f for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss") if f in SHIPPED]

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")]


@pytest.fixture(autouse=True)
def in_float32_too(monkeypatch):
    monkeypatch.setattr(experts, "GROUPED_DTYPES", (torch.bfloat16, torch.float32))


def routed(module: torch.nn.Module, num_tokens: int, top_k: int, dtype: torch.dtype, seed: int = 1):
    """Random tokens routed as a top-k router routes them: distinct experts per token, weights summing to 1."""
    generator = torch.Generator().manual_seed(seed)
    hidden = module.down_proj.shape[-1] if module.is_transposed else module.down_proj.shape[1]
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    weights, index = torch.topk(torch.rand(num_tokens, module.num_experts, generator=generator), top_k, dim=-1)
    return x, index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def eager_forward(module, *args):
    return type(module).forward.__wrapped__(module, *args)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_pass_equals_the_hf_expert_loop(family):
    model = build(family)
    assert experts.group_experts(model, available_bytes=1 << 40) == model.config.num_hidden_layers
    assert model.config._experts_implementation == experts.EXPERTS_IMPLEMENTATION
    for module in experts.expert_modules(model):
        # a decode step's few tokens, a prefill's many: some experts get none, others many
        for num_tokens in (1, 5, 97):
            x, index, weights = routed(module, num_tokens, 2, torch.float32, seed=num_tokens)
            with torch.no_grad():
                want = eager_forward(module, x, index, weights)
                got = module(x, index, weights)  # through transformers' dispatch
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_model_logits_equal_the_eager_models(family):
    model = build(family)
    eager = copy.deepcopy(model)
    eager.set_experts_implementation("eager")
    experts.group_experts(model, available_bytes=1 << 40)
    ids = torch.randint(5, 261, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eager(ids).logits, rtol=1e-5, atol=1e-5)


def test_bfloat16_stays_within_rounding_of_the_eager_loop():
    model = build("olmoe" if "olmoe" in MOE_FAMILIES else MOE_FAMILIES[0]).to(torch.bfloat16)
    if not prepack.supported(model):
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    assert experts.group_experts(model, available_bytes=1 << 40) > 0
    module = experts.expert_modules(model)[0]
    x, index, weights = routed(module, 64, 2, torch.bfloat16)
    with torch.no_grad():
        want, got = eager_forward(module, x, index, weights).float(), module(x, index, weights).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_a_class_whose_math_differs_keeps_transformers_forward(caplog):
    """The per-class check: a gate that is not what the eager loop computes is caught and left alone."""
    model = build(MOE_FAMILIES[0])
    for module in experts.expert_modules(model):
        module._apply_gate = types.MethodType(lambda self, gate_up: gate_up.chunk(2, dim=-1)[1], module)
    with caplog.at_level("DEBUG", logger="batchgen.engine.model.experts"):
        assert experts.group_experts(model, available_bytes=1 << 40) == 0
    assert model.config._experts_implementation == "grouped_mm"
    assert all(getattr(m, "_batchgen_packed_experts", None) is None for m in experts.expert_modules(model))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "kept transformers' forward (differs from its eager forward" in text
    assert text.count("MoE experts:") == 1  # one line per model, one decision per class


def test_no_copy_when_the_reordered_weights_do_not_fit(caplog):
    model = build(MOE_FAMILIES[0])
    with caplog.at_level("DEBUG", logger="batchgen.engine.model.experts"):
        assert experts.group_experts(model, available_bytes=1024) == 0
    assert model.config._experts_implementation == "grouped_mm"
    assert "grouped_mm kept (a reordered copy of the expert weights needs" in caplog.text


def test_idempotent_and_a_dense_model_is_untouched():
    model = build(MOE_FAMILIES[0])
    assert experts.group_experts(model, available_bytes=1 << 40) > 0
    packed = [m._batchgen_packed_experts for m in experts.expert_modules(model)]
    assert experts.group_experts(model, available_bytes=1 << 40) > 0
    assert [m._batchgen_packed_experts for m in experts.expert_modules(model)] == packed  # reused, not rebuilt
    assert experts.group_experts(build("mistral"), available_bytes=1 << 40) == 0


def test_autograd_and_other_dtypes_run_transformers_grouped_mm():
    model = build(MOE_FAMILIES[0])
    experts.group_experts(model, available_bytes=1 << 40)
    module = experts.expert_modules(model)[0]
    x, index, weights = routed(module, 8, 2, torch.float32)
    x.requires_grad_(True)
    out = module(x, index, weights)  # grad enabled: the upstream path, differentiable
    out.sum().backward()
    assert x.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(out.detach(), eager_forward(module, x.detach(), index, weights),
                                   rtol=1e-5, atol=1e-6)


def test_bucketed_row_counts_are_few_and_pad_little():
    buckets = [experts.bucket_rows(n) for n in range(1, 4097)]
    assert buckets[:16] == list(range(1, 17))  # a decode step's counts run exactly
    assert all(n <= b < 1.25 * n for n, b in enumerate(buckets, start=1))
    assert len(set(buckets)) <= 16 + 4 * 8  # 4 per octave above 16


def test_float32_keeps_transformers_grouped_mm_by_default(monkeypatch, caplog):
    monkeypatch.setattr(experts, "GROUPED_DTYPES", (torch.bfloat16,))
    model = build(MOE_FAMILIES[0])
    with caplog.at_level("DEBUG", logger="batchgen.engine.model.experts"):
        assert experts.group_experts(model, available_bytes=1 << 40) == 0
    assert model.config._experts_implementation == "grouped_mm"
    assert "grouped_mm kept (torch.float32: grouped_mm keeps pace there" in caplog.text


def test_the_engine_selects_it_in_bf16_by_default(monkeypatch, tokenizer, caplog):
    from batchgen.engine.engine import EngineConfig, LLMEngine
    from batchgen.engine.request import Request, SamplingParams

    monkeypatch.setattr(experts, "GROUPED_DTYPES", (torch.bfloat16,))  # the shipped default
    model = build(MOE_FAMILIES[0]).to(torch.bfloat16)
    if not prepack.supported(model):
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    with caplog.at_level("DEBUG", logger="batchgen.engine.model.experts"):
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=32, block_size=8), eos_token_ids=[])
    assert model.config._experts_implementation == experts.EXPERTS_IMPLEMENTATION
    assert caplog.text.count("MoE experts:") == 1
    done = list(engine.generate([Request("a", list(range(10, 50)), SamplingParams(max_new_tokens=5, ignore_eos=True))]))
    assert len(done[0].token_ids) == 5
    unpacked = build(MOE_FAMILIES[0]).to(torch.bfloat16)
    LLMEngine(unpacked, tokenizer, EngineConfig(num_kv_blocks=32, block_size=8, prepack_weights=False))
    assert unpacked.config._experts_implementation == "grouped_mm"  # off with the reordered weights
