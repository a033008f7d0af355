"""csrc/sample_draw.c: the whole draw in one call gives, row for row, the token of draw.py's window
path (the CPU window kernel's and torch's), on the rows that make each of its branches run: top-k,
top-p and min-p alone and together, kept sets larger than the window, untruncated rows whose tail
wins, masked rows and rows with fewer finite values than the window."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.kernels.sample_draw import sample_draw
from batchgen.engine.sampling import draw as draw_module
from batchgen.engine.sampling.draw import RowControls
from batchgen.engine.sampling.random_stream import PERM_SALT, UNIFORM_BITS
from tests.engine.sampling.test_draw import controls, random_controls, random_rows


def fused(logits: torch.Tensor, c: RowControls, window: int) -> torch.Tensor:
    got = sample_draw(logits, c.temperature, c.top_k, c.top_p, c.min_p, c.seeds, c.positions, window, PERM_SALT,
                      UNIFORM_BITS)
    if got is None:
        pytest.skip("no C compiler: the window path runs instead")
    return got


def window_path(logits: torch.Tensor, c: RowControls, window: int, monkeypatch, *, torch_ops: bool) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(draw_module, "sample_draw", lambda *args: None)
        if torch_ops:
            m.setattr(draw_module, "sample_window", lambda *args: None)
        return draw_module.draw(logits, c, window).token_ids


def special_rows(vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab_size)
    x = torch.randn(8, vocab_size, generator=gen) * 2
    x[0, : vocab_size // 2] = float("-inf")  # a masked half (min_tokens, a grammar)
    x[1] = float("-inf")
    x[1, [3, 7, 11]] = torch.tensor([0.5, 2.0, 1.0])  # fewer finite values than any window
    x[2] = float("-inf")
    x[2, 5] = 1.0  # one allowed token
    x[3] = torch.randn(vocab_size, generator=gen) * 0.05  # flat: top-p keeps most of the row
    x[4] = 0.0
    x[4, :4] = 30.0  # ties at the top, and a long tail of ties
    x[5, 9] += 40.0  # peaked
    x[6] = torch.arange(vocab_size, dtype=torch.float32) * (40.0 / vocab_size)  # spread evenly over 40 nats
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size, window", [(49152, 256), (3000, 256), (500, 8), (500, 64), (300, 299),
                                                (200, 256)])
def test_the_kernels_token_is_the_window_paths(dtype, vocab_size, window, monkeypatch):
    rows = 96
    x = torch.cat([random_rows(rows - 8, vocab_size, seed=vocab_size + window).to(dtype),
                   special_rows(vocab_size, dtype)])
    c = random_controls(rows, vocab_size, seed=window)
    got = fused(x, c, window)
    assert torch.equal(got, window_path(x, c, window, monkeypatch, torch_ops=False))
    assert torch.equal(got, window_path(x, c, window, monkeypatch, torch_ops=True))


@pytest.mark.parametrize("settings", [dict(), dict(top_p=0.999), dict(top_p=0.5), dict(top_k=40),
                                      dict(top_k=3000, top_p=0.9), dict(min_p=1e-5), dict(min_p=0.2, top_p=0.99)])
def test_each_setting_alone_over_many_positions(settings, monkeypatch):
    """One setting for every row, many draws each: the untruncated rows' tails win now and then, and
    the flat rows' top-p kept sets outgrow the window (the kernel collects again at the next cut)."""
    vocab_size, window, rows = 5000, 64, 400
    x = random_rows(rows, vocab_size, seed=7).bfloat16()
    c = controls(rows, temperature=torch.rand(rows, generator=torch.Generator().manual_seed(8)) + 0.5,
                 seeds=torch.arange(rows) * 104729 - 7, positions=torch.arange(rows) % 37, **settings)
    assert torch.equal(fused(x, c, window), window_path(x, c, window, monkeypatch, torch_ops=False))


def test_a_strided_or_non_cpu_input_is_refused_with_none():
    x = torch.randn(4, 100)
    c = controls(4)
    args = (c.temperature, c.top_k, c.top_p, c.min_p, c.seeds, c.positions, 8, PERM_SALT, UNIFORM_BITS)
    assert sample_draw(x.t().contiguous().t(), *args) is None
    assert sample_draw(x.half(), *args) is None


def test_top_k_ties_past_what_the_kernel_sorts_are_kept(monkeypatch):
    """The k-th value tied with hundreds more: all of them are kept (the window path's rule), though
    the kernel sorts only a margin past k before finding that out."""
    vocab_size, rows = 4000, 64
    x = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(2)) - 10
    x[:, :5] = torch.arange(5, 0, -1, dtype=torch.float32) + 2
    x[:, 5:305] = 1.0  # the 6th to 305th largest, all equal
    c = controls(rows, top_k=8, seeds=torch.arange(rows) * 7 + 1)
    got = fused(x, c, 256)
    assert torch.equal(got, window_path(x, c, 256, monkeypatch, torch_ops=False))
    assert (got >= 5).any() and (got < 305).all()  # the tied tokens are drawn, nothing below them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_rows_whose_tail_wins_draw_the_window_paths_tail_token(dtype, monkeypatch):
    """Flat rows at temperature 1-2 with a window of 8: the tail wins most draws, and the kernel rules
    most of its tokens out by their hash alone before hashing the rest in full."""
    vocab_size, rows = 3000, 300
    x = (torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(9)) * 0.7).to(dtype)
    x[::3, :50] -= float("inf")  # masked tokens in the tail
    c = controls(rows, temperature=1.0 + torch.arange(rows) % 2, seeds=torch.arange(rows) * 31337 + 3,
                 positions=torch.arange(rows) % 11)
    got = fused(x, c, 8)
    assert torch.equal(got, window_path(x, c, 8, monkeypatch, torch_ops=False))
    scaled = x.float() / c.temperature[:, None]
    edge = scaled.topk(8, -1).values[:, -1]
    assert int((scaled.gather(1, got[:, None])[:, 0] <= edge).sum()) > rows // 2  # the tail won
