"""Jump-forward decoding: where a row's grammar admits one continuation only, its tokens run in the
next forward as drafts instead of one decode step each.

The grammar (llguidance's `compute_ff_tokens`) forces bytes, not tokens: after `{"` of a JSON object
whose first key is "name" the text `name":` is certain, but the mask still admits `n`, `na`, `name`
and `name":` as the next token, and which one a model picks is the model's choice. The forced tokens
(llguidance tokenizes them canonically) are therefore drafts, checked like speculative decoding's:
the next chunk of the row runs its last token and its drafts, and the logits at each position give
the token the model picks there under the mask of that position's grammar state, the very token
step-by-step decoding would pick. Drafts are confirmed while they equal those picks; the first
pick that differs replaces its draft and the rest are dropped (their K/V is computed again); a
chunk that reached past the last draft also yields the next token. The output is the one decoding
without jump-forward gives, token for token, whatever the model prefers.

Only greedy rows without logprobs, logits controls (penalties, min_tokens, biases) or stop strings
jump: for them the token a position picks depends on nothing but its logits and its mask.
"""

from __future__ import annotations

from batchgen.engine.metrics import EngineMetrics
from batchgen.engine.sequence import Sequence


def eligible(seq: Sequence) -> bool:
    params = seq.request.sampling
    return (params.greedy and params.logprobs is None and not params.has_logits_controls and not params.stop
            and params.constraint is not None)


def forced_tokens(matcher, seq: Sequence, num_generated: int, max_model_len: int) -> list[int]:
    """The grammar's forced tokens after the row's `num_generated` confirmed tokens, cut so that the
    chunk that checks them still ends before the row's length limits (which then end it as usual)."""
    room = min(seq.request.sampling.max_new_tokens - num_generated,
               max_model_len - seq.num_prompt_tokens - num_generated) - 1
    if room <= 0:
        return []
    return matcher.compute_ff_tokens()[:room]


def verdict(drafts: list[int], picks: list[int]) -> tuple[int, int | None]:
    """(drafts confirmed, the token picked after them or None) from the model's picks at the
    positions a chunk reached: picks[r] is the token picked where drafts[r] stands."""
    for r, pick in enumerate(picks):
        if r == len(drafts) or pick != drafts[r]:
            return r, pick
    return len(picks), None


def count_step(metrics: EngineMetrics, grown: list[Sequence], verdicts: dict[int, tuple[int, int | None]]) -> int:
    """Count a step whose rows that gained tokens are `grown` into `metrics` (forced tokens, row
    steps); returns the tokens it added: a row's confirmed drafts count, its refused ones do not."""
    num_forced = sum(num_accepted for num_accepted, _ in verdicts.values())
    metrics.num_forced_tokens += num_forced
    metrics.num_row_steps += len(grown)
    return num_forced + sum(1 for seq in grown if seq.seq_id not in verdicts) + sum(
        token is not None for _, token in verdicts.values())
