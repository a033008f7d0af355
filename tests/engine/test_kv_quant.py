"""The int8 KV cache: quantization itself, the C kernel on int8 pages, and greedy equivalence.

The kernel is checked against a float64 reference over the dequantized cache (as test_native does
for float pages). The engine with an int8 cache is checked token for token against HF `generate`
on the same model whose attention sees fake-quantized K/V (quantize then dequantize): per token
and per head the scales do not depend on anything else, so that is the same model.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_native import reference
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchgen.engine import kv_quant, native, native_prefill
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.kv_cache import KVCacheSpec
from batchgen.engine.request import Request, SamplingParams
from batchgen.errors import ConfigError
from tests.engine.greedy_pair import generate_tokens
from tests.tiny import make_tiny_model

FAKE_QUANT_ATTENTION = "batchgen_test_int8_kv_sdpa"


def test_quantize_round_trip_is_within_half_a_step():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0] = 0.0  # an all-zero head must not divide by zero
    q, scale = kv_quant.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == kv_quant.SCALE_DTYPE and scale.shape == (50, 3)
    back = kv_quant.dequantize(q, scale, torch.float32)
    assert torch.equal(back[0], torch.zeros(3, 64))
    step = scale.float()[..., None]
    assert ((back - x).abs() <= 0.5 * step * 1.01 + 1e-30).all()
    assert q.abs().max() <= 127


def test_bytes_per_token_counts_int8_pages_and_scales():
    bf16 = KVCacheSpec(30, 3, 64, torch.bfloat16, 16)  # SmolLM2-135M's KV shape
    int8 = KVCacheSpec(30, 3, 64, torch.int8, 16)
    assert bf16.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert int8.bytes_per_token == 2 * 30 * 3 * (64 + 2)
    assert bf16.bytes_per_token / int8.bytes_per_token >= 1.9


def test_fp8_is_refused_clearly():
    # flash-attn 2 (our flash backend) has no fp8/descale path; flash-attn 3 has one but is not wired
    with pytest.raises(ConfigError, match="fp8 KV is CUDA-only .*int8"):
        kv_quant.resolve_kv_cache_dtype("fp8", torch.float32, torch.device("cpu"))
    with pytest.raises(ConfigError, match="flash-attn 3.*k_descale/v_descale.*int8"):
        kv_quant.resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        kv_quant.resolve_kv_cache_dtype("int3", torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 80, 1), (34, 2, 32, 16)])
def test_kernel_on_int8_pages_matches_float64_reference(q_dtype, num_heads, num_kv_heads, head_dim, block_size):
    kernel = native.load()
    assert kernel is not None
    rng = random.Random(head_dim)
    gen = torch.Generator().manual_seed(num_heads)
    context_lens = [1, 2, block_size, block_size + 1] + [rng.randint(1, 200) for _ in range(8)]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    order = list(range(1, num_blocks))
    rng.shuffle(order)
    tables = []
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(order[:n])
        order = order[n:]
    max_blocks = max(map(len, tables)) + 1
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    # per-token magnitudes over 3 decades: the scales must matter
    mag = torch.logspace(-1, 2, shape[0])[torch.randperm(shape[0], generator=gen)][:, None, None]
    k_cache, k_scale = kv_quant.quantize(torch.randn(shape, generator=gen) * mag)
    v_cache, v_scale = kv_quant.quantize(torch.randn(shape, generator=gen) * mag)
    q = (torch.randn(len(context_lens), num_heads, head_dim, generator=gen) * 0.05).to(q_dtype)
    scale = head_dim ** -0.5
    got = kernel(q, k_cache, v_cache, padded, torch.tensor(context_lens, dtype=torch.int32), block_size, scale,
                 (k_scale, v_scale))
    expected = reference(q, kv_quant.dequantize(k_cache, k_scale, torch.float64),
                         kv_quant.dequantize(v_cache, v_scale, torch.float64), tables, context_lens, block_size, scale)
    tol = 1e-4 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def _fake_quant_sdpa(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, kv_quant.fake_quantize(key), kv_quant.fake_quantize(value),
                                  attention_mask, **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_int8_kv_equals_generate_with_fake_quantized_kv(one_thread, tokenizer, backend, monkeypatch):
    AttentionInterface.register(FAKE_QUANT_ATTENTION, _fake_quant_sdpa)
    model = make_tiny_model("llama", seed=3)
    rng = random.Random(7)
    shared = [rng.randrange(5, 261) for _ in range(24)]
    prompts = [[rng.randrange(5, 261) for _ in range(n)] for n in (1, 3, 17, 40, 63)]
    prompts += [shared + [rng.randrange(5, 261) for _ in range(5)] for _ in range(3)]  # prefix-cache hits
    max_new = 16
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation(FAKE_QUANT_ATTENTION)
    refs = generate_tokens(ref_model, prompts, max_new)
    # chunked prefill (budget 24) makes later chunks gather int8 pages with a cached past
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=8, num_kv_blocks=64,
                          attention_backend=backend, kv_cache_dtype="int8")
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    assert engine.kv_cache.layers[0][0].dtype == torch.int8 and engine.kv_cache.scales is not None
    prefill_kernel = native_prefill.load()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    if backend == "cpu" and prefill_kernel is not None and prefill_kernel.supports(torch.float32, torch.int8, head_dim):
        # where the C prefill kernel exists it must serve the int8 pages: no SDPA fallback
        monkeypatch.setattr("batchgen.engine.backends.native_cpu.prefill_forward",
                            lambda *a, **kw: pytest.fail("int8 prefill fell back to the SDPA path"))
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
                for i, p in enumerate(prompts)]
    got = {c.request_id: c.token_ids for c in engine.generate(requests)}
    assert [got[str(i)] for i in range(len(prompts))] == refs
