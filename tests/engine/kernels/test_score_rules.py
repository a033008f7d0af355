"""Sliding windows, softcapping and sinks (ScoreRules) in every CPU attention path: the C decode
kernel (each of its float32 / bf16 / generic paths), the C prefill kernel (chunks after a cached
past included) and the SDPA backend, each against the same rules computed in float64."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine.attention.base import LayerKV, PackedSeq, ScoreRules
from batchgen.engine.attention.cpu import CpuBackend
from batchgen.engine.attention.sdpa import SdpaBackend
from batchgen.engine.kernels import paged_decode, prefill_attention

decode_kernel = paged_decode.load()
prefill_kernel = prefill_attention.load()
needs_decode = pytest.mark.skipif(decode_kernel is None, reason="no C compiler")

# (sliding window, softcap, with sinks)
RULES = [(1, None, False), (5, None, False), (16, None, False), (37, None, False), (None, 2.0, False),
         (None, None, True), (13, 3.0, True)]
RULE_IDS = [f"w{w}-cap{c}-sinks{s}" for w, c, s in RULES]


def make_rules(window, softcap, sinks, num_heads, gen) -> ScoreRules:
    return ScoreRules(window, softcap, torch.randn(num_heads, generator=gen) * 2 if sinks else None)


def reference_row(q_row, k, v, query_pos, scale, rules: ScoreRules) -> torch.Tensor:
    """One query position's output [H, D] over keys k/v [ctx, H, D], in float64, as transformers' eager."""
    scores = torch.einsum("hd,chd->hc", q_row.double(), k.double()) * scale
    if rules.softcap is not None:
        scores = torch.tanh(scores / rules.softcap) * rules.softcap
    key_pos = torch.arange(k.shape[0])
    seen = key_pos <= query_pos
    if rules.sliding_window is not None:
        seen &= key_pos > query_pos - rules.sliding_window
    scores = scores.masked_fill(~seen, float("-inf"))
    if rules.sinks is not None:
        scores = torch.cat([scores, rules.sinks.double()[:, None]], dim=-1)
        probs = scores.softmax(-1)[:, :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hc,chd->hd", probs, v.double())


def make_step(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Scattered pages holding every context token, one PackedSeq per (num_past, num_new), q for the new tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(p + n) // block_size) for p, n in specs) + 2
    order = list(range(1, num_blocks))
    rng.shuffle(order)
    seqs, start = [], 0
    for past, new in specs:
        nb = -(-(past + new) // block_size)
        seqs.append(PackedSeq(start, new, past, order[:nb]))
        order = order[nb:]
        start += new
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = (torch.randn(start, num_heads, head_dim, generator=gen) * 2).to(dtype)
    return seqs, q, k_cache, v_cache, gen


def reference(q, seqs, k_cache, v_cache, block_size, scale, rules) -> torch.Tensor:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in seqs:
        slots = [s.block_table[t // block_size] * block_size + t % block_size for t in range(s.context_len)]
        k = k_cache[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v_cache[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        for i in range(s.num_new_tokens):
            out[s.start + i] = reference_row(q[s.start + i], k, v, s.num_past_tokens + i, scale, rules)
    return out


def tolerance(dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 3e-2


@needs_decode
@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
@pytest.mark.parametrize(("dtype", "head_dim", "block_size"), [
    (torch.float32, 64, 16), (torch.float32, 128, 8), (torch.bfloat16, 64, 16), (torch.bfloat16, 128, 5),
    (torch.float32, 16, 4), (torch.bfloat16, 80, 1)])  # the last two: the generic loops
def test_decode_kernel_honours_the_rules(rule, dtype, head_dim, block_size):
    context_lens = [1, 2, 5, 16, 17, 40, 100, 3 * block_size + 1]
    specs = [(c - 1, 1) for c in context_lens]
    seqs, q, k_cache, v_cache, gen = make_step(specs, 8, 2, head_dim, block_size, dtype, head_dim + block_size)
    rules = make_rules(*rule, 8, gen)
    if rules.sliding_window is not None:  # whole blocks before every window are never read
        for s in seqs:
            for blk in s.block_table[:max(0, s.context_len - rules.sliding_window) // block_size]:
                k_cache[blk * block_size:(blk + 1) * block_size] = float("nan")
                v_cache[blk * block_size:(blk + 1) * block_size] = float("nan")
    width = max(len(s.block_table) for s in seqs) + 1  # padded wider than any table
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    got = decode_kernel(q, k_cache, v_cache, tables, lens, block_size, 0.2, None, rules)
    expected = reference(q, seqs, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), block_size, 0.2, rules)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
@pytest.mark.parametrize(("dtype", "head_dim", "block_size"), [
    (torch.float32, 64, 16), (torch.bfloat16, 64, 16), (torch.float32, 16, 5), (torch.bfloat16, 32, 1)])
@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_prefill_and_decode_of_a_mixed_step_honour_the_rules(rule, dtype, head_dim, block_size, backend):
    """Whole prompts, chunks after a cached past (starting inside and past the window) and decodes
    in one step, through the backend's forward (the C prefill kernel where it has this dtype)."""
    cls = CpuBackend if backend == "cpu" else SdpaBackend
    if not cls.available(torch.device("cpu"), dtype):
        pytest.skip(f"{backend} is not available for {dtype}")
    specs = [(0, 2), (0, 45), (3, 9), (30, 20), (60, 1), (7, 1), (100, 33), (0, 130)]
    seqs, q, k_cache, v_cache, gen = make_step(specs, 6, 2, head_dim, block_size, dtype, head_dim)
    rules = make_rules(*rule, 6, gen)
    k_new = torch.stack([k_cache[s.block_table[t // block_size] * block_size + t % block_size]
                         for s in seqs for t in range(s.num_past_tokens, s.context_len)])
    v_new = torch.stack([v_cache[s.block_table[t // block_size] * block_size + t % block_size]
                         for s in seqs for t in range(s.num_past_tokens, s.context_len)])
    impl = cls()
    got = impl.forward(q, k_new, v_new, LayerKV(k_cache, v_cache, block_size),
                       impl.build_metadata(seqs, block_size, q.device), 0.3, rules)
    expected = reference(q, seqs, k_cache, v_cache, block_size, 0.3, rules)
    tol = tolerance(dtype)
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@pytest.mark.skipif(prefill_kernel is None or not prefill_kernel.supports(torch.float32, torch.float32, 64),
                    reason="no C prefill kernel on this CPU (it needs AVX-512)")
def test_prefill_kernel_chunks_under_a_window_agree_with_one_pass():
    """A 600-token prompt in one step and as chunks over its cached past: the same rows, the window's."""
    seqs, q, k_cache, v_cache, gen = make_step([(0, 600)], 9, 3, 64, 16, torch.float32, 3)
    rules = make_rules(100, 4.0, True, 9, gen)
    whole = torch.empty_like(q)
    prefill_kernel(q, whole, k_cache, v_cache, prefill_attention.PrefillBatch.build(seqs, 16), 16, 0.125, None, rules)
    chunks = torch.empty_like(q)
    for past, new in [(0, 70), (70, 250), (320, 280)]:
        part = torch.empty(new, 9, 64)
        step = prefill_attention.PrefillBatch.build([PackedSeq(0, new, past, seqs[0].block_table)], 16)
        prefill_kernel(q[past:past + new].contiguous(), part, k_cache, v_cache, step, 16, 0.125, None, rules)
        chunks[past:past + new] = part
    torch.testing.assert_close(chunks, whole, rtol=1e-5, atol=1e-5)
    expected = reference(q, seqs, k_cache, v_cache, 16, 0.125, rules)
    torch.testing.assert_close(whole.double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rule", [(5, None, False), (13, 3.0, True)], ids=["window", "window-softcap-sinks"])
def test_int8_pages_under_the_rules_agree_between_the_c_kernels_and_sdpa(rule):
    """bf16 queries over int8 pages (the VNNI decode path, the prefill kernel's dequantizing pack)
    against SDPA over the same pages: both read the values as the pages store them."""
    from batchgen.engine.kv import quant as kv_quant

    if not CpuBackend.available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no bf16 C kernels here")
    specs = [(0, 45), (30, 20), (60, 1), (7, 1), (100, 33), (40, 1)]
    seqs, q, k_cache, v_cache, gen = make_step(specs, 8, 2, 64, 16, torch.bfloat16, 11)
    k8, k_scale = kv_quant.quantize(k_cache)
    v8, v_scale = kv_quant.quantize(v_cache)
    layer = LayerKV(k8, v8, 16, k_scale.contiguous(), v_scale.contiguous())
    rules = make_rules(*rule, 8, gen)
    slots = [s.block_table[t // 16] * 16 + t % 16 for s in seqs for t in range(s.num_past_tokens, s.context_len)]
    k_new = kv_quant.dequantize(k8, k_scale, torch.bfloat16)[slots]  # the step's new K/V, as the pages hold them
    v_new = kv_quant.dequantize(v8, v_scale, torch.bfloat16)[slots]
    outs = []
    for impl in (CpuBackend(), SdpaBackend()):
        outs.append(impl.forward(q, k_new, v_new, layer, impl.build_metadata(seqs, 16, q.device), 0.125,
                                 rules).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=3e-2, atol=3e-2)
