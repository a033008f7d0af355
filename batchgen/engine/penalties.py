"""Logits controls of vLLM's SamplingParams: repetition, presence and frequency penalties, min_tokens.

Definitions (vLLM's; `output` is the tokens this row generated so far, `prompt` its prompt):

    repetition_penalty r:  for every token id in prompt or output,
                           logit = logit / r if logit > 0 else logit * r        (1 = off; CTRL's rule,
                           as transformers' RepetitionPenaltyLogitsProcessor over prompt + output)
    frequency_penalty f:   logit -= f * count of the token in output             (0 = off)
    presence_penalty p:    logit -= p * (1 if the token is in output else 0)     (0 = off)
    min_tokens m:          while fewer than m tokens are generated, every EOS id's logit = -inf
                           (transformers' MinNewTokensLengthLogitsProcessor); stop strings are not
                           checked either (engine/stopping.py)

Applied in that order (min_tokens first, as vLLM does; -inf stays -inf through the others), to
float32 logits, before temperature, top-k and top-p. Frequency and presence count the output
only, never the prompt; repetition counts both.

Only rows with a control on have state here, and the sampler calls `apply` only when there is
one: a job without these controls pays nothing per step.
"""

from __future__ import annotations

import torch

from batchgen.engine.sequence import Sequence


class RowPenalties:
    """One row's running token statistics, updated from its token ids as they grow."""

    def __init__(self, seq: Sequence, vocab_size: int, device: torch.device):
        params = seq.request.sampling
        self.params = params
        self.num_counted = 0  # generated tokens already in `output_counts`
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [vocab_size]
        self.seen: torch.Tensor | None = None  # [vocab_size] bool: in prompt or output (repetition only)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt = torch.tensor(seq.token_ids[:seq.num_prompt_tokens], dtype=torch.long, device=device)
            self.seen[prompt[prompt < vocab_size]] = True

    def catch_up(self, seq: Sequence) -> None:
        """Count the tokens generated since the last step (token ids only grow, preempted or not)."""
        new = seq.generated_token_ids[self.num_counted:]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.long, device=self.output_counts.device)
        self.output_counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        if self.seen is not None:
            self.seen[ids] = True
        self.num_counted += len(new)

    def apply(self, logits: torch.Tensor, num_generated_tokens: int, eos_token_ids: torch.Tensor) -> torch.Tensor:
        # logits: [vocab_size] float32; returns the controlled row
        p = self.params
        if num_generated_tokens < p.min_tokens and eos_token_ids.numel():
            logits = logits.index_fill(0, eos_token_ids, float("-inf"))
        if self.seen is not None:
            penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self.seen, penalized, logits)
        if p.frequency_penalty != 0.0:
            logits = logits - p.frequency_penalty * self.output_counts
        if p.presence_penalty != 0.0:
            logits = logits - p.presence_penalty * (self.output_counts > 0).float()
        return logits


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
            self._rows[seq.seq_id] = None  # built at its first step, when the vocabulary size is known

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
                row = self._rows[seq.seq_id] = RowPenalties(seq, vocab_size, logits.device)
            row.catch_up(seq)
            logits[i] = row.apply(logits[i], seq.num_generated_tokens, self._eos)
        return logits
