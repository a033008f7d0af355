"""Logits controls of vLLM's SamplingParams: repetition, presence and frequency penalties, min_tokens.

Definitions (vLLM's; `output` is the tokens this row generated so far, `prompt` its prompt):

    repetition_penalty r:  for every token id in prompt or output,
                           logit = logit / r if logit > 0 else logit * r        (1 = off; CTRL's rule,
                           as transformers' RepetitionPenaltyLogitsProcessor over prompt + output)
    frequency_penalty f:   logit -= f * count of the token in output             (0 = off)
    presence_penalty p:    logit -= p * (1 if the token is in output else 0)     (0 = off)
    min_tokens m:          while fewer than m tokens are generated, every EOS id's and every
                           stop_token_ids id's logit = -inf (transformers'
                           MinNewTokensLengthLogitsProcessor, vLLM's min_tokens); stop strings are
                           not checked either (engine/sampling/stopping.py)

Applied in that order (min_tokens first, as vLLM does; -inf stays -inf through the others), to
float32 logits, before temperature, top-k and top-p. Frequency and presence count the output
only, never the prompt; repetition counts both.

Only rows with a control on have state here, and the sampler calls `apply` only when there is
one: a job without these controls pays nothing per step.
"""

from __future__ import annotations

import torch

from batchgen.engine.scheduler.sequence import Sequence


class RowPenalties:
    """One row's running token statistics, updated from its token ids as they grow.

    Sparse: a row touches the logits of the tokens it has seen (hundreds), never the whole
    vocabulary, as transformers' processors gather and scatter."""

    def __init__(self, seq: Sequence):
        self.params = params = seq.request.sampling
        self.num_counted = 0  # generated tokens already in `output_counts`
        self.output_counts: dict[int, int] = {}  # token id -> times generated
        # prompt and output tokens (repetition penalty only); a tensor of them is cached per growth
        self.seen: set[int] | None = set(seq.token_ids[:seq.num_prompt_tokens]) \
            if params.repetition_penalty != 1.0 else None
        self._seen_ids: torch.Tensor | None = None

    def catch_up(self, seq: Sequence) -> None:
        """Count the tokens generated since the last step (token ids only grow, preempted or not)."""
        for token in seq.token_ids[seq.num_prompt_tokens + self.num_counted:]:
            self.output_counts[token] = self.output_counts.get(token, 0) + 1
            if self.seen is not None and token not in self.seen:
                self.seen.add(token)
                self._seen_ids = None
            self.num_counted += 1

    def apply(self, logits: torch.Tensor, num_generated_tokens: int, eos_token_ids: torch.Tensor) -> None:
        # logits: [vocab_size] float32, changed in place
        p, device, vocab_size = self.params, logits.device, logits.shape[0]
        if num_generated_tokens < p.min_tokens:
            if eos_token_ids.numel():
                logits.index_fill_(0, eos_token_ids, float("-inf"))
            stop_ids = [t for t in p.stop_token_ids if t < vocab_size]  # they end a row as EOS does
            if stop_ids:
                logits.index_fill_(0, torch.tensor(stop_ids, dtype=torch.long, device=device), float("-inf"))
        if self.seen is not None:
            if self._seen_ids is None or self._seen_ids.device != device:
                self._seen_ids = torch.tensor(sorted(t for t in self.seen if t < vocab_size), dtype=torch.long,
                                              device=device)
            values = logits[self._seen_ids]
            logits[self._seen_ids] = torch.where(values > 0, values / p.repetition_penalty,
                                                 values * p.repetition_penalty)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and self.output_counts:
            ids = torch.tensor(list(self.output_counts), dtype=torch.long, device=device)
            counts = torch.tensor(list(self.output_counts.values()), dtype=torch.float32, device=device)
            keep = ids < vocab_size
            logits.index_add_(0, ids[keep], -(p.frequency_penalty * counts[keep] + p.presence_penalty))


class Penalties:
    """The rows with a logits control on, by seq_id; `apply` controls their logits rows."""

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)
        self._rows: dict[int, RowPenalties | None] = {}  # None until the row's first step
        self._eos: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self._rows)

    def add(self, seq: Sequence) -> None:
        """Called when a request enters the engine; rows without a control are not tracked."""
        if seq.request.sampling.has_logits_controls:
            self._rows[seq.seq_id] = None  # built at its first step

    def release(self, seq: Sequence) -> None:
        self._rows.pop(seq.seq_id, None)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # logits: [num_seqs, vocab_size], row i belongs to seqs[i]; returns float32 logits
        logits = logits.float()  # exact for bf16/fp16 values: unpenalized rows keep their argmax
        vocab_size = logits.shape[-1]
        if self._eos is None or self._eos.device != logits.device:
            self._eos = torch.tensor([t for t in self.eos_token_ids if t < vocab_size], dtype=torch.long,
                                     device=logits.device)
        for i, seq in enumerate(seqs):
            if seq.seq_id not in self._rows:
                continue
            row = self._rows[seq.seq_id]
            if row is None:
                row = self._rows[seq.seq_id] = RowPenalties(seq)
            row.catch_up(seq)
            row.apply(logits[i], seq.num_generated_tokens, self._eos)
        return logits
