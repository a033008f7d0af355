"""Log-probabilities of the drawn tokens and their likeliest alternatives, for the rows that ask.

The distribution is the one the token was drawn from: log_softmax of the processed logits, that is
after penalties, temperature and top-k / top-p / min-p (tokens these drop have logprob -inf and are
never listed as alternatives). A greedy row's processed logits are its logits after penalties.
Computed only for the rows with `SamplingParams.logprobs` set, batched over them.
"""

from __future__ import annotations

import torch

from batchgen.engine.request import TokenLogprob
from batchgen.engine.sampling.draw import Drawn


def sampled_logprobs(drawn: Drawn, rows: list[int], top_counts: list[int]) -> list[TokenLogprob]:
    """Rows (indices into the draw) of a draw made with logprobs=True; top_counts: K per row."""
    index = torch.tensor(rows, dtype=torch.long, device=drawn.token_ids.device)
    lse = drawn.log_normalizer[index]
    chosen = (drawn.chosen_values[index] - lse).tolist()
    k = min(max(top_counts), drawn.values.shape[1])
    top_values = (drawn.values[index, :k] - lse[:, None]).tolist()
    top_ids = drawn.value_ids[index, :k].tolist()
    token_ids = drawn.token_ids[index].tolist()
    return [_entry(token_ids[r], chosen[r], top_ids[r], top_values[r], top_counts[r]) for r in range(len(rows))]


def greedy_logprobs(logits: torch.Tensor, token_ids: list[int], top_counts: list[int]) -> list[TokenLogprob]:
    """logits: [rows, vocab_size] of greedy rows (after penalties); token_ids: their argmax tokens."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    chosen = (x.gather(1, torch.tensor(token_ids, device=x.device)[:, None])[:, 0] - lse).tolist()
    k = min(max(top_counts), x.shape[-1])
    top = torch.topk(x, k, dim=-1)
    top_values = (top.values - lse[:, None]).tolist()
    top_ids = top.indices.tolist()
    return [_entry(token_ids[r], chosen[r], top_ids[r], top_values[r], top_counts[r]) for r in range(len(token_ids))]


def _entry(token_id: int, logprob: float, ids: list[int], values: list[float], k: int) -> TokenLogprob:
    top = tuple((i, v) for i, v in zip(ids[:k], values[:k], strict=True) if v != float("-inf"))
    return TokenLogprob(token_id, logprob, top)
