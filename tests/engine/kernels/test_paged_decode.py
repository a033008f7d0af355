"""The C decode kernel (engine/kernels/paged_decode.py) against plain attention, and its fallback when
it cannot build."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine.attention import registry
from batchgen.engine.kernels import kernel_cache, loader, paged_decode


@pytest.fixture(scope="module")
def kernel() -> paged_decode.PagedDecodeKernel:
    k = paged_decode.load()
    assert k is not None, "the kernel must build where a C compiler is present (CI has gcc)"
    return k


def reference(q, k_cache, v_cache, tables, context_lens, block_size, scale):
    """Per sequence: gather its context token by token, then softmax(q k^T) v in float64."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for b, ctx in enumerate(context_lens):
        slots = [tables[b][t // block_size] * block_size + t % block_size for t in range(ctx)]
        k = k_cache[slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, H, D]
        v = v_cache[slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,chd->hc", q[b].double(), k) * scale
        out.append(torch.einsum("hc,chd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 80, 1), (2, 1, 8, 32), (32, 8, 64, 16),
                          (34, 2, 32, 16),  # 17 query heads per KV head: more than one 16-head chunk
                          (36, 2, 64, 16),  # bf16 path: 18 query heads per KV head, more than one register pass
                          (6, 2, 64, 5)])  # bf16 path: 16-token groups that straddle 5-token blocks
def test_matches_plain_attention(kernel, dtype, num_heads, num_kv_heads, head_dim, block_size):
    rng = random.Random(head_dim * block_size)
    gen = torch.Generator().manual_seed(num_heads)
    context_lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1] + [rng.randint(1, 300) for _ in range(11)]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    order = list(range(1, num_blocks))
    rng.shuffle(order)  # blocks scattered over the cache, as after a long run
    tables = []
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(order[:n])
        order = order[n:]
    max_blocks = max(map(len, tables)) + 2  # padded wider than any table: the kernel must read only ctx
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[:block_size] = float("nan")  # block 0 pads the tables and must never be read
    v_cache[:block_size] = float("nan")
    q = (torch.randn(len(context_lens), num_heads, head_dim, generator=gen) * 3).to(dtype)
    scale = head_dim ** -0.5
    got = kernel(q, k_cache, v_cache, padded, torch.tensor(context_lens, dtype=torch.int32), block_size, scale)
    expected = reference(q, k_cache, v_cache, tables, context_lens, block_size, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


def test_is_deterministic_across_thread_counts(kernel):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(64 * 16, 2, 64, generator=gen)
    v_cache = torch.randn(64 * 16, 2, 64, generator=gen)
    q = torch.randn(20, 4, 64, generator=gen)
    tables = torch.arange(60, dtype=torch.int32).view(20, 3)
    lens = torch.randint(1, 48, (20,), generator=gen, dtype=torch.int32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k_cache, v_cache, tables, lens, 16, 0.125)
        torch.set_num_threads(2)
        two = kernel(q, k_cache, v_cache, tables, lens, 16, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two), "a row's result must not depend on how rows are split over threads"


def test_without_a_compiler_the_engine_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))  # nothing built yet
    paged_decode.load.cache_clear()
    loader.load_library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert paged_decode.load() is None
        assert "torch attention path" in caplog.text
        assert registry.resolve_backend("auto", torch.device("cpu"), None) == ("sdpa", 16)
        with pytest.raises(ValueError, match="C compiler"):
            registry.resolve_backend("cpu", torch.device("cpu"), None)
    finally:
        paged_decode.load.cache_clear()
        loader.load_library.cache_clear()


def test_build_is_cached_and_keyed_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    first = loader.build(paged_decode.SOURCE)
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    again = loader.build(paged_decode.SOURCE)
    assert again == first and first.stat().st_mtime_ns == mtime, "a second build reuses the file"
    assert not [p for p in first.parent.iterdir() if p not in (first, kernel_cache.digest_path(first))], \
        "no temporary files left behind"


@pytest.mark.parametrize("tamper", ["content", "mode", "owner", "no digest", "symlink"])
def test_an_untrusted_cached_kernel_is_built_again_not_loaded(monkeypatch, tmp_path, caplog, tamper):
    """Loading a .so runs its code: one another user could have written (a shared cache dir) is
    never loaded, whatever its owner, mode or bytes."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    source = loader.CSRC / "argmax.c"
    built = loader.build(source)
    good = built.read_bytes()
    assert kernel_cache.problem(built) is None
    assert kernel_cache.digest_path(built).read_text().strip() == kernel_cache.sha256(built)
    assert not built.stat().st_mode & 0o022
    if tamper == "content":
        built.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same owner and mode: the digest tells
    elif tamper == "mode":
        built.chmod(0o777)
    elif tamper == "owner":
        monkeypatch.setattr(kernel_cache.os, "geteuid", lambda: built.stat().st_uid + 1)
    elif tamper == "no digest":
        kernel_cache.digest_path(built).unlink()
    else:
        elsewhere = tmp_path / "elsewhere.so"
        built.rename(elsewhere)
        built.symlink_to(elsewhere)
    assert kernel_cache.problem(built) is not None
    if tamper == "owner":
        monkeypatch.undo()  # the rebuild is this user's again
        monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(kernel_cache, "problem", _refuse_once(kernel_cache.problem))
    with caplog.at_level("WARNING"):
        again = loader.build(source)
    assert again == built and "building it again" in caplog.text
    assert not again.is_symlink() and kernel_cache.problem(again) is None  # built and recorded anew
    if tamper == "content":
        assert again.read_bytes() != good[:-1] + bytes([good[-1] ^ 1])


def _refuse_once(real):
    calls = []

    def problem(target):
        calls.append(target)
        return "is owned by uid 12345, not by this user" if len(calls) == 1 else real(target)
    return problem
