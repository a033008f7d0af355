"""The C prefill kernel (engine/kernels/prefill_attention.py) against causal attention in float64, on float
and int8 pages, and the CPU backend's choice between it and the SDPA path."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.attention.base import LayerKV, PackedSeq
from batchgen.engine.attention.cpu import CpuBackend
from batchgen.engine.attention.sdpa import SdpaBackend
from batchgen.engine.kernels import prefill_attention

kernel = prefill_attention.load()
needs_kernel = pytest.mark.skipif(kernel is None or not kernel.supports(torch.float32, torch.float32, 64),
                                  reason="no C prefill kernel on this CPU (it needs AVX-512)")


def make_step(specs: list[tuple[int, int]], num_kv_heads: int, head_dim: int, block_size: int, dtype, seed: int):
    """Paged caches holding every context token, blocks scattered, block 0 NaN (padding, never read),
    and one PackedSeq per (num_past, num_new)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(p + n) // block_size) for p, n in specs) + 3
    order = list(range(1, num_blocks))
    rng.shuffle(order)
    seqs, start = [], 0
    for past, new in specs:
        nb = -(-(past + new) // block_size)
        seqs.append(PackedSeq(start, new, past, order[:nb]))
        order = order[nb:]
        start += new
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[:block_size] = float("nan")
    v_cache[:block_size] = float("nan")
    return seqs, start, k_cache, v_cache, gen


def reference(q, seqs, k_cache, v_cache, block_size, scale) -> dict[int, torch.Tensor]:
    """Each prefill sequence's output rows, causal with the cached past, in float64."""
    out = {}
    for i, s in enumerate(seqs):
        if s.num_new_tokens < 2:
            continue
        slots = [s.block_table[t // block_size] * block_size + t % block_size for t in range(s.context_len)]
        k = k_cache[slots].double().transpose(0, 1)[None]
        v = v_cache[slots].double().transpose(0, 1)[None]
        qs = q[s.start:s.start + s.num_new_tokens].double().transpose(0, 1)[None]
        mask = torch.arange(s.context_len)[None, :] <= torch.arange(s.num_past_tokens, s.context_len)[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[i] = o[0].transpose(0, 1)
    return out


SPECS = [(0, 2), (0, 17), (5, 3), (0, 100), (37, 64), (200, 1), (0, 31), (15, 97), (3, 129)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 128, 8), (4, 2, 16, 5), (6, 2, 32, 1), (12, 2, 96, 16),
                          (40, 2, 64, 16)])  # 20 query heads per KV head: a tile of few positions
def test_matches_causal_attention(dtype, num_heads, num_kv_heads, head_dim, block_size):
    if not kernel.supports(dtype, dtype, head_dim):
        pytest.skip(f"no {dtype} kernel on this CPU")
    seqs, num_tokens, k_cache, v_cache, gen = make_step(SPECS, num_kv_heads, head_dim, block_size, dtype, head_dim)
    q = (torch.randn(num_tokens, num_heads, head_dim, generator=gen) * 2).to(dtype)
    out = torch.full_like(q, 7.0)  # rows of one-token sequences are not the kernel's: left as they were
    scale = head_dim ** -0.5
    batch = prefill_attention.PrefillBatch.build(seqs, block_size)
    kernel(q, out, k_cache, v_cache, batch, block_size, scale)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: inputs, probabilities and output in bf16
    for i, expected in reference(q, seqs, k_cache, v_cache, block_size, scale).items():
        s = seqs[i]
        got = out[s.start:s.start + s.num_new_tokens].double()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=f"sequence {s}")
    single = seqs[5]
    assert (out[single.start] == 7.0).all()


@needs_kernel
def test_long_prompt_tiles_and_past_chunks_agree_with_one_pass():
    """A 1,500-token prompt in one step, and the same prompt as three chunks over its cached past,
    give the same rows (float32): tiles shrink with the context and chunks read the pages."""
    specs = [(0, 1500)]
    seqs, n, k_cache, v_cache, gen = make_step(specs, 3, 64, 16, torch.float32, 1)
    q = torch.randn(n, 9, 64, generator=gen)
    whole = torch.empty_like(q)
    kernel(q, whole, k_cache, v_cache, prefill_attention.PrefillBatch.build(seqs, 16), 16, 0.125)
    table = seqs[0].block_table
    chunks = torch.empty_like(q)
    for past, new in [(0, 700), (700, 500), (1200, 300)]:
        step = [PackedSeq(0, new, past, table)]
        part = torch.empty(new, 9, 64)
        batch = prefill_attention.PrefillBatch.build(step, 16)
        kernel(q[past:past + new].contiguous(), part, k_cache, v_cache, batch, 16, 0.125)
        chunks[past:past + new] = part
    torch.testing.assert_close(chunks, whole, rtol=1e-5, atol=1e-5)
    expected = reference(q, seqs, k_cache, v_cache, 16, 0.125)[0]
    torch.testing.assert_close(whole.double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_backend_matches_the_sdpa_backend_on_a_mixed_step(dtype):
    if not kernel.supports(dtype, dtype, 64):
        pytest.skip(f"no {dtype} kernel on this CPU")
    specs = [(0, 40), (33, 1), (10, 25), (90, 1), (0, 3)]
    seqs, n, k_cache, v_cache, gen = make_step(specs, 3, 64, 16, dtype, 5)
    q = torch.randn(n, 9, 64, generator=gen).to(dtype)
    k_new = torch.randn(n, 3, 64, generator=gen).to(dtype)  # the step's new K/V as the model made them
    v_new = torch.randn(n, 3, 64, generator=gen).to(dtype)
    for s in seqs:  # ... and as attention.py wrote them into the pages before the backend runs
        for i in range(s.num_new_tokens):
            t = s.num_past_tokens + i
            slot = s.block_table[t // 16] * 16 + t % 16
            k_cache[slot], v_cache[slot] = k_new[s.start + i], v_new[s.start + i]
    layer = LayerKV(k_cache, v_cache, 16)
    native_backend, sdpa = CpuBackend(), SdpaBackend()
    got = native_backend.forward(q, k_new, v_new, layer, native_backend.build_metadata(seqs, 16, q.device), 0.125)
    expected = sdpa.forward(q, k_new, v_new, layer, sdpa.build_metadata(seqs, 16, q.device), 0.125)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


def test_unsupported_head_sizes_keep_the_sdpa_path():
    if kernel is None:
        pytest.skip("no C prefill kernel here")
    assert not kernel.supports(torch.float32, torch.float32, 80)
    assert not kernel.supports(torch.float32, torch.float32, 256)
    assert not kernel.supports(torch.float32, torch.int8, 80)
    assert not kernel.supports(torch.float32, torch.bfloat16, 64)  # float pages must be the query's dtype
    assert not kernel.supports(torch.float16, torch.float16, 64)
    assert not kernel.supports(torch.float16, torch.int8, 64)
