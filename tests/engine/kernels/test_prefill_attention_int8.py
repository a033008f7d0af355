"""The C prefill kernel on int8 pages (--kv-cache-dtype int8): dequantized as it packs each
context, bit for bit as `kv_quant.dequantize`, so it is checked two ways: against float64 causal
attention over the dequantized cache, and for exact equality with the same kernel run over float
pages that hold `kv_quant.dequantize`'s values."""

from __future__ import annotations

import pytest
import torch
from test_prefill_attention import SPECS, make_step, reference

from batchgen.engine.attention.base import LayerKV
from batchgen.engine.attention.cpu import CpuBackend
from batchgen.engine.attention.sdpa import SdpaBackend
from batchgen.engine.kernels import prefill_attention
from batchgen.engine.kv import quant as kv_quant

kernel = prefill_attention.load()
needs_kernel = pytest.mark.skipif(kernel is None or not kernel.supports(torch.float32, torch.int8, 64),
                                  reason="no C prefill kernel on this CPU (it needs AVX-512)")
SHAPES = [(9, 3, 64, 16), (4, 4, 128, 8), (4, 2, 16, 5), (6, 2, 32, 1), (12, 2, 96, 16), (40, 2, 64, 16)]


def int8_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, seed: int):
    """make_step's float caches with per-token magnitudes over two decades (so the scales matter),
    quantized: (k int8, v int8, (k_scale, v_scale)); block 0's scales NaN (padding, never read)."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-1, 1, k_cache.shape[0])[torch.randperm(k_cache.shape[0], generator=gen)][:, None, None]
    kq, ks = kv_quant.quantize(k_cache.float().nan_to_num(0.0) * mag)
    vq, vs = kv_quant.quantize(v_cache.float().nan_to_num(0.0) * mag)
    ks[:block_size] = vs[:block_size] = float("nan")
    return kq, vq, (ks, vs)


def _skip_without(dtype, head_dim):
    if not kernel.supports(dtype, torch.int8, head_dim):
        pytest.skip(f"no {dtype} kernel over int8 pages on this CPU")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES)
def test_int8_pages_match_causal_attention_over_the_dequantized_cache(dtype, num_heads, num_kv_heads, head_dim,
                                                                      block_size):
    _skip_without(dtype, head_dim)
    seqs, num_tokens, k_f, v_f, gen = make_step(SPECS, num_kv_heads, head_dim, block_size, torch.float32, head_dim)
    kq, vq, scales = int8_pages(k_f, v_f, block_size, head_dim)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    kernel(q, out, kq, vq, prefill_attention.PrefillBatch.build(seqs, block_size), block_size, scale, scales)
    k64, v64 = (kv_quant.dequantize(x, s, torch.float64) for x, s in zip((kq, vq), scales, strict=True))
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: inputs, probabilities and output in bf16
    for i, expected in reference(q, seqs, k64, v64, block_size, scale).items():
        s = seqs[i]
        got = out[s.start:s.start + s.num_new_tokens].double()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item(), msg=f"seq {s}")
    assert (out[seqs[5].start] == 7.0).all()  # a one-token sequence is the decode kernel's


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES[:3])
def test_int8_pages_equal_float_pages_holding_their_dequantized_values(dtype, num_heads, num_kv_heads, head_dim,
                                                                       block_size):
    """The pack's dequantization is kv_quant.dequantize's to the bit: everything after it is the
    float kernel's, so the outputs are equal, not close."""
    _skip_without(dtype, head_dim)
    seqs, num_tokens, k_f, v_f, gen = make_step(SPECS, num_kv_heads, head_dim, block_size, torch.float32, 3)
    kq, vq, scales = int8_pages(k_f, v_f, block_size, 4)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    batch = prefill_attention.PrefillBatch.build(seqs, block_size)
    from_int8, from_float = torch.zeros_like(q), torch.zeros_like(q)
    kernel(q, from_int8, kq, vq, batch, block_size, 0.1, scales)
    kd, vd = (kv_quant.dequantize(x, s, dtype) for x, s in zip((kq, vq), scales, strict=True))
    kernel(q, from_float, kd, vd, batch, block_size, 0.1)
    assert torch.equal(from_int8, from_float)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_backend_on_int8_pages_matches_the_sdpa_backend(dtype, monkeypatch):
    """A mixed step as attention.py runs it: the new K/V quantized into the pages first, then the
    CPU backend's prefill kernel (no SDPA fallback) against the SDPA backend's gathers."""
    _skip_without(dtype, 64)
    specs = [(0, 40), (33, 1), (10, 25), (90, 1), (0, 3)]
    seqs, n, k_f, v_f, gen = make_step(specs, 3, 64, 16, torch.float32, 5)
    kq, vq, (ks, vs) = int8_pages(k_f, v_f, 16, 6)
    q = torch.randn(n, 9, 64, generator=gen).to(dtype)
    k_new = (torch.randn(n, 3, 64, generator=gen) * 3).to(dtype)  # the step's new K/V as the model made them
    v_new = (torch.randn(n, 3, 64, generator=gen) * 3).to(dtype)
    slots = torch.tensor([s.block_table[t // 16] * 16 + t % 16 for s in seqs
                          for t in range(s.num_past_tokens, s.context_len)])
    kv_quant.write(kq, vq, ks, vs, slots, k_new, v_new)
    layer = LayerKV(kq, vq, 16, ks, vs)
    native_backend, sdpa = CpuBackend(), SdpaBackend()
    monkeypatch.setattr("batchgen.engine.attention.cpu.prefill_forward",
                        lambda *a, **kw: pytest.fail("int8 prefill fell back to the SDPA path"))
    # both get the model's K/V, as attention.py passes them (SDPA fake-quantizes what it reads directly)
    got = native_backend.forward(q, k_new, v_new, layer, native_backend.build_metadata(seqs, 16, q.device), 0.125)
    expected = sdpa.forward(q, k_new, v_new, layer, sdpa.build_metadata(seqs, 16, q.device), 0.125)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())
