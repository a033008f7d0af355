"""score: each row's log-likelihood of its own tokens under a causal LM.

A row of tokens t_0..t_{L-1} scores the tokens from `score_from` (1 by default: every token after the
first, as vLLM's prompt logprobs) to the end: sum over i in [score_from, L) of log p(t_i | t_<i), the
logit at position i - 1 read at t_i. The decoder runs once over the packed batch; the LM head then runs
only on the positions some row scores, a chunk at a time, so a batch never holds [tokens, vocab] logits
(SmolLM2's 49,152-token vocabulary is 192 KiB of float32 per position). Each position's log-probability
is taken from its logits as they come out of the head (engine/kernels/target_logprob.py: float32
arithmetic on bfloat16 logits, without a float32 copy of them) and each row's sum is accumulated in
float64 whatever the model's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from batchgen.engine.encode.heads import LogitRule
from batchgen.engine.kernels.target_logprob import target_logprobs

# float32 logits one LM-head chunk may hold (256 MiB): bounds the head's memory whatever the batch
CHUNK_LOGIT_ELEMENTS = 1 << 26


def scored_positions(cu_seqlens: Sequence[int], score_from: Sequence[int | None]
                     ) -> tuple[list[int], list[int]]:
    """(first predicting position, number of scored tokens) of each row of a packed batch. A
    score_from of None or below 1 means 1 (the first token has nothing before it to predict it);
    one at or past the row's end scores nothing."""
    firsts, counts = [], []
    for i, start_from in enumerate(score_from):
        start, end = cu_seqlens[i], cu_seqlens[i + 1]
        first = max(1, 1 if start_from is None else start_from)
        count = max(0, end - start - first)
        firsts.append(start + first - 1)
        counts.append(count)
    return firsts, counts


@torch.no_grad()
def score_hidden(head: torch.nn.Module, rule: LogitRule, hidden: torch.Tensor, input_ids: torch.Tensor,
                 cu_seqlens: Sequence[int], score_from: Sequence[int | None]) -> list[tuple[float, int]]:
    """(sum of log-probabilities, number of scored tokens) per row, from the decoder's hidden states
    [T, hidden] of a packed batch whose rows span input_ids [T] at cu_seqlens."""
    assert hidden.shape[0] == input_ids.shape[0] == cu_seqlens[-1], (hidden.shape, input_ids.shape, cu_seqlens)
    firsts, counts = scored_positions(cu_seqlens, score_from)
    device = hidden.device
    num_rows = len(counts)
    totals = torch.zeros(num_rows, dtype=torch.float64, device=device)
    if sum(counts):
        positions = torch.cat([torch.arange(f, f + n, device=device) for f, n in zip(firsts, counts, strict=True)])
        rows = torch.repeat_interleave(torch.arange(num_rows, device=device),
                                       torch.tensor(counts, device=device))
        targets = input_ids.to(device)[positions + 1]
        vocab = head.weight.shape[0]
        chunk = max(1, CHUNK_LOGIT_ELEMENTS // vocab)
        scaled = rule != LogitRule()
        for lo in range(0, positions.numel(), chunk):
            hi = lo + chunk
            logits = head(hidden[positions[lo:hi]])
            if scaled:
                logits = rule.apply(logits.float())
            totals.index_add_(0, rows[lo:hi], target_logprobs(logits, targets[lo:hi]).to(device))
    return [(float(total), count) for total, count in zip(totals.tolist(), counts, strict=True)]


def perplexity(logprob: float, num_scored_tokens: int) -> float | None:
    """exp(-mean log-probability); None for a row that scored no token."""
    if num_scored_tokens <= 0:
        return None
    return math.exp(-logprob / num_scored_tokens)
