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
works on each row's `window` largest values (one topk over the batch):

    a truncated row: every kept token is in the window when its threshold > the window's smallest x;
        else the row draws again over a window 8 times larger, then over its sorted vocabulary, with
        the same noise per token id, so the token is the one the whole vocabulary gives
    an untruncated row: the tokens strictly above the window's smallest x race as themselves, the rest
        (the tail) as one pseudo-token of logit logsumexp(tail) with its own noise (the maximum of
        Gumbels is a Gumbel at their logsumexp, and which tail token holds it is independent of its
        value); only when the tail wins does the row hash its whole vocabulary, to draw within the tail

Which path a row takes depends on its own logits and settings only (the window sizes are fixed,
never taken from its batch-mates, and every reduction runs along one row), so a row's token does not
depend on its batch.

On the CPU, a step whose rows ask for no logprobs draws in one C call (kernels/sample_draw.py) that
gives the token this window path gives, without building the window's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.kernels.sample_draw import sample_draw
from batchgen.engine.kernels.sample_window import sample_window
from batchgen.engine.sampling.random_stream import PERM_SALT, UNIFORM_BITS, gumbel, row_keys

# a truncated row whose kept set outgrows the window tries one this many times larger, then a sort
WINDOW_GROWTH = 8


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
    """A draw's result and what logprobs need: the processed (kept, scaled) values of the window
    (None when the CPU kernel drew without a window: a draw without logprobs)."""

    token_ids: torch.Tensor  # [rows] int64
    values: torch.Tensor | None  # [rows, window] float32: x in descending order, -inf where not kept
    value_ids: torch.Tensor | None  # [rows, window] int64: the token ids of `values`
    # [rows] float32: logsumexp of the kept x over the whole row; None unless asked for (a full pass)
    log_normalizer: torch.Tensor | None
    chosen_values: torch.Tensor | None = None  # [rows] float32: x of the drawn token; with logprobs only


class _Scaled:
    """logits / temperature of the sampling rows, made whole only when a step needs every value
    (the CPU kernel reads the first window straight from the logits)."""

    def __init__(self, logits: torch.Tensor, temperature: torch.Tensor):
        self.logits = logits  # [rows, vocab_size], the model's dtype
        self.temperature = temperature  # [rows] float32
        self._x: torch.Tensor | None = None

    def full(self) -> torch.Tensor:  # [rows, vocab_size] float32
        if self._x is None:
            self._x = self.logits / self.temperature[:, None]
        return self._x

    def rows(self, index: torch.Tensor) -> torch.Tensor:  # the same values, for some rows
        if self._x is not None:
            return self._x[index]
        return self.logits[index] / self.temperature[index, None]

    def select(self, index: torch.Tensor) -> _Scaled:
        scaled = _Scaled(self.logits[index], self.temperature[index])
        scaled._x = None if self._x is None else self._x[index]
        return scaled


def draw(logits: torch.Tensor, controls: RowControls, window: int, *, logprobs: bool = False) -> Drawn:
    """logits: [rows, vocab_size] of the sampling rows (any float dtype; not changed)."""
    if not logprobs:
        token_ids = sample_draw(logits, controls.temperature, controls.top_k, controls.top_p, controls.min_p,
                                controls.seeds, controls.positions, window, PERM_SALT, UNIFORM_BITS)
        if token_ids is not None:
            return Drawn(token_ids, None, None, None)
    vocab_size = logits.shape[-1]
    scaled = _Scaled(logits, controls.temperature)
    first = sample_window(logits, controls.temperature, window) if window < vocab_size else None
    drawn, fallback, full_lse = _draw_window(scaled, controls, min(window, vocab_size), None, logprobs=logprobs,
                                             first=first)
    level = window
    while fallback is not None and bool(fallback.any()):
        level = vocab_size if level * WINDOW_GROWTH ** 2 > vocab_size else level * WINDOW_GROWTH
        rows = fallback.nonzero()[:, 0]
        some = scaled.select(rows)
        wider_first = sample_window(some.logits, some.temperature, level) if level < vocab_size else None
        wider, wider_fallback, _ = _draw_window(some, controls.select(rows), level,
                                                None if full_lse is None else full_lse[rows], logprobs=logprobs,
                                                first=wider_first)
        # the first `window` columns of the wider draw: logprobs' top alternatives are its first ones
        drawn.token_ids[rows] = wider.token_ids
        drawn.values[rows] = wider.values[:, :drawn.values.shape[1]]
        drawn.value_ids[rows] = wider.value_ids[:, :drawn.values.shape[1]]
        if logprobs:
            drawn.log_normalizer[rows] = wider.log_normalizer
        fallback = None if wider_fallback is None else torch.zeros_like(fallback).index_fill_(
            0, rows[wider_fallback], True)
    if logprobs:
        drawn.chosen_values = logits.gather(1, drawn.token_ids[:, None])[:, 0] / controls.temperature
    return drawn


def _logsumexp(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """logsumexp along rows whose maximum is known (the window's first value): three passes, not five."""
    return row_max + (x - row_max[:, None]).exp_().sum(-1).log_()


def _draw_window(scaled: _Scaled, c: RowControls, window: int, full_lse: torch.Tensor | None, *, logprobs: bool,
                 first: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[Drawn, torch.Tensor | None, torch.Tensor | None]:
    # returns the draw, the truncated rows whose kept set outgrew the window ([rows] bool; None for
    # a window of the whole vocabulary) and the rows' logsumexp if computed; `first`: the CPU
    # kernel's (values, ids, logsumexp) of this window
    vocab_size = scaled.logits.shape[-1]
    whole = window >= vocab_size
    if first is not None:
        vals, ids, full_lse = first
    elif whole:
        vals, ids = torch.sort(scaled.full(), dim=-1, descending=True)
    else:
        vals, ids = torch.topk(scaled.full(), window, dim=-1)  # [rows, window], descending
    neg_inf = torch.tensor(float("-inf"), device=vals.device)
    threshold = torch.full_like(vals[:, 0], float("-inf"))
    top_k_on = (c.top_k > 0) & (c.top_k < vocab_size)
    if c.max_top_k:
        kth = vals.gather(1, (c.top_k.clamp(1, vals.shape[1]) - 1)[:, None])[:, 0]
        # a top-k beyond the window: the window's edge as threshold sends the row to a wider window
        threshold = torch.where(top_k_on, torch.where(c.top_k <= vals.shape[1], kth, vals[:, -1]), threshold)
    untruncated = ~top_k_on & (c.top_p >= 1.0) & (c.min_p <= 0.0)
    if full_lse is None and (logprobs or (c.any_top_p and not bool(top_k_on.all())) or bool(untruncated.any())):
        full_lse = _logsumexp(scaled.full(), vals[:, 0])
    if c.any_top_p:
        top_p_on = c.top_p < 1.0
        kept_k = vals >= threshold[:, None]
        lse = full_lse
        if c.max_top_k:
            lse_k = torch.logsumexp(torch.where(kept_k, vals, neg_inf), dim=-1)
            lse = lse_k if full_lse is None else torch.where(top_k_on, lse_k, full_lse)
        probs = torch.exp(vals - lse[:, None]).masked_fill_(~kept_k, 0.0)
        mass_before = probs.cumsum(-1).sub_(probs)
        num_kept = ((mass_before < c.top_p[:, None]) & kept_k).sum(-1).clamp_(min=1)
        last_kept = vals.gather(1, (num_kept - 1)[:, None])[:, 0]
        threshold = torch.where(top_p_on, torch.maximum(threshold, last_kept), threshold)
    if c.any_min_p:
        floor = vals[:, 0] + torch.log(c.min_p)  # log(0) = -inf: off
        threshold = torch.maximum(threshold, floor)
    edge = vals[:, -1]
    if not whole:  # an untruncated row's window: the tokens strictly above the edge (ties go to the tail)
        threshold = torch.where(untruncated, torch.nextafter(edge, torch.full_like(edge, float("inf"))), threshold)
    key_lo, key_hi = row_keys(c.seeds, c.positions)
    values = torch.where(vals >= threshold[:, None], vals, neg_inf)
    best, best_col = (values + gumbel(key_lo, key_hi, ids, vocab_size)).max(dim=-1)
    token_ids = ids.gather(1, best_col[:, None])[:, 0]
    if not whole and bool(untruncated.any()):
        _race_the_tail(scaled, values, edge, best, full_lse, key_lo, key_hi, untruncated, token_ids)
    log_normalizer = None
    if logprobs:
        log_normalizer = torch.where(untruncated, full_lse, torch.logsumexp(values, dim=-1))
        values = torch.where(untruncated[:, None], vals, values)  # an untruncated row keeps its whole window
    drawn = Drawn(token_ids, values, ids, log_normalizer)
    if whole:
        return drawn, None, full_lse
    # a top-k beyond the window: its top-p above was renormalized over the window only
    beyond = top_k_on & (c.top_k > vals.shape[1]) if c.max_top_k else False
    return drawn, (~untruncated & (threshold <= edge)) | beyond, full_lse


def _race_the_tail(scaled: _Scaled, values: torch.Tensor, edge: torch.Tensor, best: torch.Tensor,
                   full_lse: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, untruncated: torch.Tensor,
                   token_ids: torch.Tensor) -> None:
    """Untruncated rows: the tail (x <= edge) as one pseudo-token against the window's best score;
    where it wins, the draw within the tail. Changes `token_ids` in place.

    The tail's logsumexp is the row's less the window's, to float32 rounding: a tail of less mass
    than that rounding (1e-6 of the row's) never wins, where it would win once in a million draws."""
    # a window holding -inf holds every finite value: no tail to race
    rows = (untruncated & (edge > float("-inf"))).nonzero()[:, 0]
    window_share = torch.exp(values[rows] - full_lse[rows, None]).sum(-1)  # exp(-inf) = 0 outside
    tail_lse = full_lse[rows] + torch.log((1.0 - window_share).clamp_(min=0.0))
    vocab_size = scaled.logits.shape[-1]
    device = scaled.logits.device
    lo, hi = key_lo[rows], key_hi[rows]
    tail_id = torch.full((1,), vocab_size, dtype=torch.long, device=device)  # the pseudo-token's own noise
    wins = tail_lse + gumbel(lo, hi, tail_id, vocab_size)[:, 0] > best[rows]
    if bool(wins.any()):
        won = wins.nonzero()[:, 0]
        tail = scaled.rows(rows[won])
        tail.masked_fill_(tail > edge[rows[won], None], float("-inf"))
        all_ids = torch.arange(vocab_size, device=device)
        score, tail_token = (tail + gumbel(lo[won], hi[won], all_ids, vocab_size)).max(dim=-1)
        # a tail of -inf only (its mass a rounding of the window's share) keeps the window's token
        real = score > float("-inf")
        token_ids[rows[won][real]] = tail_token[real]
