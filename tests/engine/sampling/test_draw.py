"""The batched draw (engine/sampling/draw.py): the sampled distribution is the softmax, the kept sets
are exactly top-k / top-p / min-p's, the window gives the token the whole vocabulary would, and a row's
token does not depend on the rows drawn with it."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.sampling import draw as draw_module
from batchgen.engine.sampling.draw import RowControls, draw


@pytest.fixture(autouse=True, params=["draw-kernel", "window-kernel", "torch"])
def window_path(request, monkeypatch):
    """Every test three times: the whole draw in the CPU kernel (a draw without logprobs), the window
    path with its first window from the CPU kernel, and the window path in torch ops (other devices)."""
    if request.param != "draw-kernel":
        monkeypatch.setattr(draw_module, "sample_draw", lambda *args: None)
    if request.param == "torch":
        monkeypatch.setattr(draw_module, "sample_window", lambda *args: None)
    return request.param


# chi-square critical values at p = 0.0001 (scipy.stats.chi2.isf(1e-4, df)), by degrees of freedom
CHI2_CRITICAL = {7: 29.88, 11: 35.56, 19: 47.21}


def controls(rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None) -> RowControls:
    def column(value, dtype):
        return value.to(dtype) if isinstance(value, torch.Tensor) else torch.full((rows,), value, dtype=dtype)

    top_k_t = column(top_k, torch.long)
    top_p_t = column(top_p, torch.float32)
    min_p_t = column(min_p, torch.float32)
    return RowControls(
        temperature=column(temperature, torch.float32), top_k=top_k_t, top_p=top_p_t, min_p=min_p_t,
        seeds=seeds if seeds is not None else torch.arange(rows, dtype=torch.long),
        positions=positions if positions is not None else torch.zeros(rows, dtype=torch.long),
        max_top_k=int(top_k_t.max()), any_top_p=bool((top_p_t < 1).any()), any_min_p=bool((min_p_t > 0).any()))


def reference_kept(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The kept tokens of one scaled row by the definitions, in float64 over a full sort."""
    x = x.double()
    order = torch.sort(x, descending=True).values
    threshold = -math.inf
    if 0 < top_k < x.numel():
        threshold = order[top_k - 1].item()
    if top_p < 1.0:
        survivors = order[order >= threshold]
        probs = torch.softmax(survivors, -1)
        before = torch.cumsum(probs, -1) - probs
        last = int((before < top_p).sum()) - 1
        threshold = max(threshold, survivors[last].item())
    if min_p > 0.0:
        threshold = max(threshold, order[0].item() + math.log(min_p))
    return x >= threshold


def kept_mask(drawn, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(drawn.values.shape[0], vocab_size, dtype=torch.bool)
    rows, cols = torch.isfinite(drawn.values).nonzero(as_tuple=True)
    mask[rows, drawn.value_ids[rows, cols]] = True
    return mask


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    nonzero = expected > 0
    assert counts[~nonzero].sum() == 0, "drew a token of probability 0"
    return (((counts - expected) ** 2)[nonzero] / expected[nonzero]).sum().item()


@pytest.mark.parametrize("window", [4, 256], ids=["window-fallback", "window"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_distribution_is_the_softmax(window, temperature):
    """20 000 independent draws (seeds x positions) of one fixed logit row against its softmax."""
    logits = torch.randn(20, generator=torch.Generator().manual_seed(3)) * 1.5
    rows = 20_000
    seeds = torch.arange(rows, dtype=torch.long) // 4
    positions = torch.arange(rows, dtype=torch.long) % 4
    drawn = draw(logits.expand(rows, -1).clone(), controls(rows, temperature=temperature, seeds=seeds,
                                                           positions=positions), window)
    assert chi_square(drawn.token_ids, torch.softmax(logits / temperature, -1)) < CHI2_CRITICAL[19]


@pytest.mark.parametrize("settings, df", [(dict(top_k=8), 7), (dict(top_p=0.8), None), (dict(min_p=0.1), None),
                                          (dict(top_k=12, top_p=0.9), None)])
def test_truncated_distribution_is_the_renormalized_softmax(settings, df):
    logits = torch.randn(20, generator=torch.Generator().manual_seed(4)) * 1.5
    keep = reference_kept(logits, settings.get("top_k", 0), settings.get("top_p", 1.0), settings.get("min_p", 0.0))
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    rows = 20_000
    drawn = draw(logits.expand(rows, -1).clone(), controls(rows, seeds=torch.arange(rows) * 7919, **settings), 256)
    df = int(keep.sum()) - 1
    critical = CHI2_CRITICAL.get(df) or df + 4.0 * math.sqrt(2 * df) + 10  # ~p 1e-4 for the others
    assert chi_square(drawn.token_ids, probs) < critical


def random_rows(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=gen) * 6 + 0.2  # flat to peaked rows
    x = torch.randn(rows, vocab_size, generator=gen) * scale
    return x.bfloat16().float()  # bf16 values: ties, as real logits have


def random_controls(rows: int, vocab_size: int, seed: int) -> RowControls:
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, 4, (rows,), generator=gen)
    top_k = torch.where((pick == 1) | (pick == 3), torch.randint(1, vocab_size + 5, (rows,), generator=gen), 0)
    top_p = torch.where(pick >= 2, torch.rand(rows, generator=gen) * 0.99 + 0.01, torch.ones(rows))
    min_p = torch.where(pick == 3, torch.rand(rows, generator=gen) * 0.3, torch.zeros(rows))
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.3
    return controls(rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    seeds=torch.randint(-2**62, 2**62, (rows,), generator=gen),
                    positions=torch.randint(0, 5000, (rows,), generator=gen))


@pytest.mark.parametrize("window", [8, 64, 10_000])
def test_kept_sets_are_exact(window):
    rows, vocab_size = 300, 500
    x = random_rows(rows, vocab_size, seed=window)
    c = random_controls(rows, vocab_size, seed=window)
    drawn = draw(x.clone(), c, window, logprobs=True)
    scaled = x / c.temperature[:, None]
    got = kept_mask(drawn, vocab_size)
    window_cols = min(window, vocab_size)
    for r in range(rows):
        expected = reference_kept(scaled[r], int(c.top_k[r]), float(c.top_p[r]), float(c.min_p[r]))
        if expected.sum() <= window_cols:  # the window holds the kept set (else only a prefix of it)
            assert torch.equal(got[r], expected), r
        assert expected[drawn.token_ids[r]], r


def test_a_truncated_row_draws_in_the_window_what_the_whole_vocabulary_draws():
    """Its kept set is exact and its noise keyed by token id: the window only saves work. (An
    untruncated row races its tail as one pseudo-token, so its draw depends on the window size, which
    is fixed; the chi-square tests cover its distribution.)"""
    rows, vocab_size = 400, 700
    x = random_rows(rows, vocab_size, seed=11)
    c = random_controls(rows, vocab_size, seed=12)
    truncated = ((c.top_k > 0) | (c.top_p < 1) | (c.min_p > 0)).nonzero()[:, 0]
    c, x = c.select(truncated), x[truncated]
    full = draw(x.clone(), c, vocab_size).token_ids
    for window in (1, 16, 128):
        assert torch.equal(draw(x.clone(), c, window).token_ids, full), window


@pytest.mark.parametrize("window", [1, 3, 8])
def test_an_untruncated_rows_tail_race_keeps_the_softmax(window):
    """A peaked row: the tail (beyond a tiny window) wins now and then, and is drawn within."""
    logits = torch.tensor([4.0, 3.0, 2.5, 2.0, 1.0, 1.0, 0.5, 0.0, -1.0, -3.0, -3.0, -5.0])
    rows = 20_000
    drawn = draw(logits.expand(rows, -1).clone(), controls(rows, seeds=torch.arange(rows) * 31 + 5), window)
    assert chi_square(drawn.token_ids, torch.softmax(logits, -1)) < CHI2_CRITICAL[11]


def test_a_rows_token_does_not_depend_on_its_batch():
    rows, vocab_size = 64, 3000
    x = random_rows(rows, vocab_size, seed=21)
    c = random_controls(rows, vocab_size, seed=22)
    batched = draw(x.clone(), c, 32).token_ids
    alone = [draw(x[r:r + 1].clone(), c.select(torch.tensor([r])), 32).token_ids.item() for r in range(rows)]
    assert batched.tolist() == alone
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(5))
    assert torch.equal(draw(x[perm].clone(), c.select(perm), 32).token_ids, batched[perm])


def test_log_normalizer_is_the_processed_rows_logsumexp():
    rows, vocab_size = 50, 400
    x = random_rows(rows, vocab_size, seed=31)
    c = random_controls(rows, vocab_size, seed=32)
    drawn = draw(x.clone(), c, 16, logprobs=True)
    scaled = x / c.temperature[:, None]
    for r in range(rows):
        keep = reference_kept(scaled[r], int(c.top_k[r]), float(c.top_p[r]), float(c.min_p[r]))
        expected = torch.logsumexp(scaled[r].masked_fill(~keep, float("-inf")), -1)
        assert abs(drawn.log_normalizer[r].item() - expected.item()) < 1e-4, r
