"""The engine on a real GPU (marker `gpu`; skipped without CUDA): `pytest -m gpu`.

benchmarks/gpu/gpu_check.sh runs these on a GPU machine. Exact greedy equality with HF generate is
checked in float32 (the torch backend); flash-attn runs only fp16/bf16, where two different
kernels may round a near-tie differently, so flash is checked against itself: CUDA-graph decode
against eager decode over the same kernel family.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import _common, make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _flash_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _workload(seed: int, n: int = 24) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 261) for _ in range(rng.randint(1, 300))] for _ in range(n)]
    return prompts, [rng.randint(1, 40) for _ in range(n)]


def _generate_refs(model, prompts, max_new) -> list[list[int]]:
    refs = []
    for p, n in zip(prompts, max_new, strict=True):
        ids = torch.tensor([p], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


def _engine_tokens(model, tokenizer, config: EngineConfig, prompts, max_new) -> tuple[LLMEngine, list[list[int]]]:
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[-1])
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    got = {c.request_id: c.token_ids for c in engine.generate(requests)}
    return engine, [got[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_float32_greedy_equals_generate_on_cuda(arch, tokenizer):
    model = make_tiny_model(arch, seed=1).cuda()
    prompts, max_new = _workload(1)
    refs = _generate_refs(model, prompts, max_new)
    _, got = _engine_tokens(model, tokenizer, EngineConfig(attention_backend="sdpa", kv_cache_bytes=64 * 2**20,
                                                           max_num_batched_tokens=256), prompts, max_new)
    assert got == refs


@pytest.mark.skipif(not _flash_installed(), reason="needs flash-attn")
def test_auto_picks_flash_and_graph_decode_matches_eager(tokenizer):
    model = make_tiny_model("llama", seed=2).to("cuda", torch.bfloat16)
    prompts, max_new = _workload(2, n=40)
    config = EngineConfig(kv_cache_bytes=256 * 2**20, max_num_seqs=32)
    graphed, with_graphs = _engine_tokens(model, tokenizer, config, prompts, max_new)
    assert graphed.runner.backend.name == "flash" and graphed.block_size == 256
    stats = graphed.runner.graphs.stats
    assert stats.num_graph_steps > 0 and stats.num_padding_rows > 0
    eager, without = _engine_tokens(model, tokenizer, EngineConfig(kv_cache_bytes=256 * 2**20, max_num_seqs=32,
                                                                   cuda_graphs=False), prompts, max_new)
    assert eager.runner.graphs is None
    same = sum(a == b for a, b in zip(with_graphs, without, strict=True))
    assert same >= 0.9 * len(prompts), f"only {same}/{len(prompts)} rows equal with and without graphs"
    timing = graphed.runner.timing.summary()
    assert timing["num_steps"] > 0 and timing["forward_ms_per_step"] > 0


def test_oom_recovery_on_cuda(tokenizer, monkeypatch):
    model = make_tiny_model("llama", seed=3).cuda()
    prompts, max_new = _workload(3, n=12)
    refs = _generate_refs(model, prompts, max_new)
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(attention_backend="sdpa",
                                                                     kv_cache_bytes=32 * 2**20), eos_token_ids=[-1])
    real, calls = engine.runner._forward, []

    def forward(*args):
        calls.append(1)
        if len(calls) == 4:
            raise torch.cuda.OutOfMemoryError("injected")
        return real(*args)

    monkeypatch.setattr(engine.runner, "_forward", forward)
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    got = {c.request_id: c.token_ids for c in engine.generate(requests)}
    assert [got[str(i)] for i in range(len(prompts))] == refs and engine.metrics.num_oom_retries == 1


def test_fp8_kv_on_cuda_is_refused_naming_what_it_needs(tokenizer):
    """fp8 KV is not wired (engine/kv_quant.fp8_refusal): on a real GPU the engine must refuse it up
    front, naming flash-attn 3, not fall back to another cache dtype. When fp8 is wired, this test
    becomes its greedy check against a dequantize-on-read reference."""
    from batchgen.errors import ConfigError

    model = make_tiny_model("llama", seed=1).to("cuda", torch.bfloat16)
    with pytest.raises(ConfigError, match="flash-attn 3"):
        LLMEngine(model, tokenizer, EngineConfig(kv_cache_bytes=64 * 2**20, kv_cache_dtype="fp8"), eos_token_ids=[-1])


def _windowed_mistral(seed: int):
    from transformers import MistralConfig

    torch.manual_seed(seed)
    config = MistralConfig(**_common(sliding_window=32, head_dim=64, hidden_size=256, num_attention_heads=4))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def test_float32_sliding_window_greedy_equals_generate_on_cuda(tokenizer):
    model = _windowed_mistral(3).cuda()
    prompts, max_new = _workload(3, n=12)
    refs = _generate_refs(model, prompts, max_new)
    _, got = _engine_tokens(model, tokenizer, EngineConfig(attention_backend="sdpa", kv_cache_bytes=64 * 2**20,
                                                           max_num_batched_tokens=128), prompts, max_new)
    assert got == refs


@pytest.mark.skipif(not _flash_installed(), reason="needs flash-attn")
def test_flash_sliding_window_graph_decode_matches_eager(tokenizer):
    # flash-attn's window_size against itself (bf16), as the full-attention test above: graphs vs eager
    model = _windowed_mistral(4).to("cuda", torch.bfloat16)
    prompts, max_new = _workload(4, n=16)
    config = EngineConfig(attention_backend="flash", kv_cache_bytes=256 * 2**20, max_num_seqs=16)
    graphed, with_graphs = _engine_tokens(model, tokenizer, config, prompts, max_new)
    _, eager = _engine_tokens(model, tokenizer, dataclasses.replace(config, cuda_graphs=False), prompts, max_new)
    assert graphed.use_cuda_graphs and with_graphs == eager


# local/global layers (KV in layer groups) and MoE blocks (transformers' own experts on CUDA), as
# tests/engine/test_families_generate.py builds them on the CPU; the reference attention each accepts
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=12, query_pre_attn_scalar=20,
                                        layer_types=["sliding_attention", "full_attention"]), "eager"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, moe_intermediate_size=32,
                                         num_experts_per_tok=2), "sdpa"),
    "mixtral": ("MixtralConfig", dict(sliding_window=12, num_local_experts=4, num_experts_per_tok=2), "sdpa"),
}


@pytest.mark.parametrize("family", [f for f, (cls, _, _) in FAMILIES.items() if hasattr(transformers, cls)])
def test_float32_local_global_and_moe_greedy_equals_generate_on_cuda(family, tokenizer):
    cls, kwargs, attn = FAMILIES[family]
    torch.manual_seed(5)
    config = getattr(transformers, cls)(**_common(**kwargs))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval().cuda()
    prompts, max_new = _workload(5, n=12)
    refs = _generate_refs(model, prompts, max_new)
    engine, got = _engine_tokens(model, tokenizer, EngineConfig(attention_backend="sdpa", kv_cache_bytes=64 * 2**20,
                                                                max_num_batched_tokens=128), prompts, max_new)
    assert (engine.kv_groups is not None) == (family == "gemma3")
    assert got == refs
