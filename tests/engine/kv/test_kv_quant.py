"""The int8 KV cache: quantization itself, the C kernel on int8 pages, and greedy equivalence.

The kernel is checked against a float64 reference over the dequantized cache (as test_paged_decode does
for float pages). The engine with an int8 cache is checked token for token against HF `generate`
on the same model whose attention sees fake-quantized K/V (quantize then dequantize): per token
and per head the scales do not depend on anything else, so that is the same model.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchgen.engine.attention.base import LayerKV, PackedSeq
from batchgen.engine.attention.sdpa import build_prefills, prefill_forward
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.kernels import kv_quant_write, paged_decode, prefill_attention
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.kv.cache import KVCacheSpec
from batchgen.engine.request import Request, SamplingParams
from batchgen.errors import ConfigError
from tests.engine.greedy_pair import generate_tokens
from tests.engine.kernels.test_paged_decode import reference
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


def _kv_for_write(dtype: torch.dtype, tokens: int, heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """[tokens, heads, head_dim] as the attention op gets it (a transposed view) over 60 decades,
    with the heads the write must get right: all zero, below MIN_SCALE, huge, exact halves."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-30, 30, tokens * heads).view(tokens, heads, 1)[torch.randperm(tokens, generator=gen)]
    x = torch.randn(heads, tokens, head_dim, generator=gen).transpose(0, 1) * mag
    x[0, 0] = 0.0
    x[1, 0] = 1e-16  # max|x| / 127 under MIN_SCALE: the clamp decides the scale
    x[2, -1] = torch.finfo(torch.bfloat16).max / 2
    # max|x| = 127 gives scale 1 exactly, so these land on half steps: rounded half to even
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 127.0])
    x[3, 0] = halves.repeat(-(-head_dim // len(halves)))[:head_dim]
    x[3, 0, 0] = 127.0
    return x.to(dtype)


def _pages(num_slots: int, heads: int, head_dim: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # garbage in the slots the write must leave alone
    cache = torch.randint(-128, 128, (num_slots, heads, head_dim), generator=gen, dtype=torch.int8)
    scale = torch.randn(num_slots, heads, generator=gen).to(kv_quant.SCALE_DTYPE)
    return [cache, cache.clone(), scale, scale.clone()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(37, 3, 64), (130, 2, 128), (5, 4, 80), (9, 1, 17)])
def test_c_write_stores_the_bytes_of_torch_quantize(dtype, tokens, heads, head_dim):
    kernel = kv_quant_write.load()
    assert kernel is not None
    num_slots = 2 * tokens + 3
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(tokens))[:tokens]
    k = _kv_for_write(dtype, tokens, heads, head_dim, seed=1)
    v = _kv_for_write(dtype, tokens, heads, head_dim, seed=2).transpose(1, 2).contiguous().transpose(1, 2)
    assert heads == 1 or (k.stride(0) == head_dim and v.stride(-1) == heads)  # head-major k; v strided in head_dim
    got, want = _pages(num_slots, heads, head_dim), _pages(num_slots, heads, head_dim)
    kv_quant.write(*got, slots, k, v)  # the C write on CPU
    kv_quant.write_torch(*want, slots, k, v)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.int8 if g.dtype == torch.int8 else torch.int16),
                           w.view(torch.int8 if w.dtype == torch.int8 else torch.int16))  # bits, not values
    q, s = kv_quant.quantize(k)
    assert torch.equal(got[0][slots], q) and torch.equal(got[2][slots], s)
    halves_rounded = torch.tensor([0, 2, 2, 0, -2, 126, -126, 127] * head_dim, dtype=torch.int8)[:head_dim]
    halves_rounded[0] = 127
    assert torch.equal(got[0][slots[3], 0], halves_rounded) and got[2][slots[3], 0] == 1.0
    assert torch.equal(got[0][slots[0], 0], torch.zeros(head_dim, dtype=torch.int8))


def test_c_write_refuses_slots_outside_the_pages_and_writes_nothing():
    kernel = kv_quant_write.load()
    assert kernel is not None
    pages = _pages(8, 2, 16)
    before = [t.clone() for t in pages]
    k = torch.randn(3, 2, 16)
    with pytest.raises(IndexError, match="1 of 3 cache slots are outside"):
        kernel.write(*pages, torch.tensor([0, 8, 2]), k, k)
    assert all(torch.equal(a, b) for a, b in zip(pages, before, strict=True))


def test_sdpa_prefill_attends_over_the_new_kv_as_the_int8_pages_hold_them():
    # the write returns nothing: a prefill with no cached past (SDPA over the step's own K/V, not
    # the pages) must quantize them itself, to exactly what a later gather of its pages reads
    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, head_dim, block_size = 12, 4, 2, 16, 4
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 3 for _ in range(2))
    block_table = [2, 0, 3]
    slots = torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in range(tokens)])
    pages = _pages(4 * block_size, kv_heads, head_dim)
    kv_quant.write(*pages, slots, k, v)
    layer = LayerKV(pages[0], pages[1], block_size, pages[2], pages[3])
    prefills = build_prefills([PackedSeq(0, tokens, 0, block_table)], block_size, torch.device("cpu"))
    assert prefills[0].block_ids is None
    out = torch.empty_like(q)
    prefill_forward(q, k, v, layer, prefills, 0.25, out)
    k_held = kv_quant.gather(layer.blocks()[0], pages[2], torch.tensor(block_table), k.dtype).flatten(0, 1)[:tokens]
    assert torch.equal(k_held, kv_quant.fake_quantize(k)) and not torch.equal(k_held, k)

    def sdpa(kk, vv):  # [1, heads, tokens, head_dim], as prefill_forward calls it
        qp, kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in (q, kk, vv))
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=0.25, enable_gqa=True)
        return o[0].transpose(0, 1)

    assert torch.equal(out, sdpa(kv_quant.fake_quantize(k), kv_quant.fake_quantize(v)))
    assert not torch.equal(out, sdpa(k, v))


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


@pytest.mark.parametrize("q_magnitude", [0.05, 0.5])  # near-flat and peaked softmaxes
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 80, 1), (34, 2, 32, 16), (6, 2, 96, 16),
                          (4, 1, 256, 16)])
def test_kernel_on_int8_pages_matches_float64_reference(q_dtype, q_magnitude, num_heads, num_kv_heads, head_dim,
                                                       block_size):
    kernel = paged_decode.load()
    assert kernel is not None
    rng = random.Random(head_dim)
    gen = torch.Generator().manual_seed(num_heads)
    # 255-257 and 700: the AVX512-VNNI path sums V in int32 over 256-token chunks
    context_lens = [1, 2, block_size, block_size + 1, 255, 256, 257, 700] + [rng.randint(1, 200) for _ in range(8)]
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
    q = (torch.randn(len(context_lens), num_heads, head_dim, generator=gen) * q_magnitude).to(q_dtype)
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


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
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
    prefill_kernel = prefill_attention.load()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    if backend == "cpu" and prefill_kernel is not None and prefill_kernel.supports(torch.float32, torch.int8, head_dim):
        # where the C prefill kernel exists it must serve the int8 pages: no SDPA fallback
        monkeypatch.setattr("batchgen.engine.attention.cpu.prefill_forward",
                            lambda *a, **kw: pytest.fail("int8 prefill fell back to the SDPA path"))
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
                for i, p in enumerate(prompts)]
    got = {c.request_id: c.token_ids for c in engine.generate(requests)}
    assert [got[str(i)] for i in range(len(prompts))] == refs


def test_write_falls_back_to_torch_ops_where_the_c_write_does_not_apply():
    kernel = kv_quant_write.load()
    assert kernel is not None
    k = torch.randn(5, 2, 16).to(torch.float16)  # a dtype the C write does not take
    got, want = _pages(8, 2, 16), _pages(8, 2, 16)
    assert not kernel.write(*got, torch.arange(5), k, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # declined: nothing written
    kv_quant.write(*got, torch.arange(5), k, k)
    kv_quant.write_torch(*want, torch.arange(5), k, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and torch.equal(got[0][:5], got[1][:5])
    assert not torch.equal(got[0], _pages(8, 2, 16)[0])


def test_decode_steps_on_the_cpu_backend_run_no_torch_quantize_or_dequantize(one_thread, tokenizer, monkeypatch):
    # one-token prompts: every step is a decode step (C write, C decode kernel on the int8 pages)
    def forbidden(*args, **kwargs):
        raise AssertionError("a decode step on int8 pages ran a torch quantize/dequantize")

    monkeypatch.setattr(kv_quant, "quantize", forbidden)
    monkeypatch.setattr(kv_quant, "dequantize", forbidden)
    config = EngineConfig(max_num_seqs=4, block_size=8, num_kv_blocks=16, attention_backend="cpu",
                          kv_cache_dtype="int8")
    engine = LLMEngine(make_tiny_model("llama", seed=3), tokenizer, config, eos_token_ids=[])
    requests = [Request(str(i), [t], SamplingParams(max_new_tokens=5, ignore_eos=True))
                for i, t in enumerate((7, 40, 200))]
    assert all(len(c.token_ids) == 5 for c in engine.generate(requests))
