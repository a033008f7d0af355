"""One batched draw for every sampling row of a step: temperature, top-k, top-p, min-p, Gumbel-max.

Every truncation is a per-row threshold on the temperature-scaled logits x = logit / temperature:

    top-k  keeps x >= the k-th largest x                          (ties with it stay)
    top-p  keeps x >= the x of the last token, in descending order, whose probability mass before it
           (renormalized over the top-k survivors when top-k is on) is below top_p
    min-p  keeps x >= max x + log(min_p)                          (p >= min_p * p_max)

so the kept set is a function of the row's values alone (never of how a sort orders ties), and the
threshold is the largest of the three. The token drawn is argmax over kept tokens of x + gumbel
(engine/sampling/random_stream.py).

Sorting or hashing a whole vocabulary per row would cost more than the forward on a CPU, so the draw
works on each row's `window` largest values (one topk over the batch) and proves that enough:

    a truncated row: every kept token is in the window when its threshold > the window's smallest x
    an untruncated row: a token outside the window scores at most window_min + GUMBEL_MAX, so the
                        window's best score above that is the row's best

Rows where the proof fails (a flat distribution; a top-k larger than the window) draw again over
their whole sorted vocabulary with the same noise, so the token is the same either way. Whether a row
falls back depends on its own logits and settings only: the window size is fixed, never taken from
its batch-mates, and every reduction runs along one row, so a row's token does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.sampling.random_stream import GUMBEL_MAX, gumbel, row_keys

# float32 rounding of the noise and of x + noise stays far inside this margin
_GUMBEL_BOUND = GUMBEL_MAX + 1e-3


@dataclass(slots=True)
class RowControls:
    """The sampling rows' settings as tensors, row i for the i-th sampling row: [rows] each."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    min_p: torch.Tensor  # float32, 0 = off
    seeds: torch.Tensor  # int64 (the seed's low 64 bits, signed)
    positions: torch.Tensor  # int64: the index of the token being drawn in the row's own output
    max_top_k: int  # 0 when no row asks for top-k
    any_top_p: bool
    any_min_p: bool

    def select(self, rows: torch.Tensor) -> RowControls:
        return RowControls(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
                           self.seeds[rows], self.positions[rows], self.max_top_k, self.any_top_p, self.any_min_p)


@dataclass(slots=True)
class Drawn:
    """A draw's result and what logprobs need: the processed (kept, scaled) values of the window."""

    token_ids: torch.Tensor  # [rows] int64
    values: torch.Tensor  # [rows, window] float32: x in descending order, -inf where not kept
    value_ids: torch.Tensor  # [rows, window] int64: the token ids of `values`
    # [rows] float32: logsumexp of the kept x over the whole row; None unless asked for (a full pass)
    log_normalizer: torch.Tensor | None


def draw(x: torch.Tensor, controls: RowControls, window: int, *, logprobs: bool = False) -> Drawn:
    """x: [rows, vocab_size] float32 logits of the sampling rows, scaled in place by temperature."""
    x.div_(controls.temperature[:, None])
    vocab_size = x.shape[-1]
    if window >= vocab_size:
        return _draw_window(x, controls, vocab_size, check=False, logprobs=logprobs)[0]
    drawn, fallback = _draw_window(x, controls, window, check=True, logprobs=logprobs)
    if not bool(fallback.any()):
        return drawn
    rows = fallback.nonzero()[:, 0]
    full = _draw_window(x[rows], controls.select(rows), vocab_size, check=False, logprobs=logprobs)[0]
    # the window's columns of the fallback rows: their logprobs' top alternatives are the sort's first
    drawn.token_ids[rows] = full.token_ids
    drawn.values[rows] = full.values[:, :window]
    drawn.value_ids[rows] = full.value_ids[:, :window]
    if logprobs:
        drawn.log_normalizer[rows] = full.log_normalizer
    return drawn


def _draw_window(x: torch.Tensor, c: RowControls, window: int, *, check: bool,
                 logprobs: bool) -> tuple[Drawn, torch.Tensor | None]:
    # x: [rows, vocab_size]; returns the draw and (check only) the rows whose proof failed [rows] bool
    vocab_size = x.shape[-1]
    if window >= vocab_size:
        vals, ids = torch.sort(x, dim=-1, descending=True)
    else:
        vals, ids = torch.topk(x, window, dim=-1)  # [rows, window], descending
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    threshold = torch.full_like(vals[:, 0], float("-inf"))
    top_k_on = (c.top_k > 0) & (c.top_k < vocab_size)
    if c.max_top_k:
        kth = vals.gather(1, (c.top_k.clamp(1, window) - 1)[:, None])[:, 0]
        # a top-k beyond the window: keep nothing to the threshold here; the check sends it to the sort
        threshold = torch.where(top_k_on, torch.where(c.top_k <= window, kth, vals[:, -1]), threshold)
    full_lse = None
    if c.any_top_p:
        full_lse = torch.logsumexp(x, dim=-1)
        top_p_on = c.top_p < 1.0
        kept_k = vals >= threshold[:, None]
        lse_k = torch.logsumexp(torch.where(kept_k, vals, neg_inf), dim=-1)
        lse = torch.where(top_k_on, lse_k, full_lse)
        probs = torch.exp(vals - lse[:, None]).masked_fill_(~kept_k, 0.0)
        mass_before = probs.cumsum(-1).sub_(probs)
        num_kept = ((mass_before < c.top_p[:, None]) & kept_k).sum(-1).clamp_(min=1)
        last_kept = vals.gather(1, (num_kept - 1)[:, None])[:, 0]
        threshold = torch.where(top_p_on, torch.maximum(threshold, last_kept), threshold)
    if c.any_min_p:
        floor = vals[:, 0] + torch.log(c.min_p)  # log(0) = -inf: off
        threshold = torch.maximum(threshold, floor)
    key_lo, key_hi = row_keys(c.seeds, c.positions)
    kept = vals >= threshold[:, None]
    values = torch.where(kept, vals, neg_inf)
    scores = values + gumbel(key_lo, key_hi, ids, vocab_size)
    best, best_col = scores.max(dim=-1)
    token_ids = ids.gather(1, best_col[:, None])[:, 0]
    truncated = threshold > float("-inf")
    log_normalizer = None
    if logprobs:
        log_normalizer = torch.logsumexp(values, dim=-1)
        if not bool(truncated.all()):
            if full_lse is None:
                full_lse = torch.logsumexp(x, dim=-1)
            log_normalizer = torch.where(truncated, log_normalizer, full_lse)
    drawn = Drawn(token_ids, values, ids, log_normalizer)
    if not check:
        return drawn, None
    edge = vals[:, -1]
    fallback = torch.where(truncated, threshold <= edge, best <= edge + _GUMBEL_BOUND)
    return drawn, fallback
