"""Logits controls of vLLM's SamplingParams: repetition, presence and frequency penalties, min_tokens,
logit_bias and allowed_token_ids.

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

    allowed_token_ids:     every other token's logit = -inf (vLLM's; empty = no limit)
    logit_bias:            logit += bias for each (token id, bias) (OpenAI's and vLLM's)

Applied in that order (min_tokens first, as vLLM does; -inf stays -inf through the others; the
token controls before the penalties, as vLLM's logits processors run before its penalties), to
float32 logits, before temperature, top-k and top-p. Frequency and presence count the output
only, never the prompt; repetition counts both.

Only rows with a control on have state here, and the sampler calls `apply` only when there is
one: a job without these controls pays nothing per step. A step applies every row's controls at
once: each row contributes the ids it touches (a cached tensor per row, rebuilt only when its output
grew), and one scatter per control changes them all in the flat [rows * vocab] logits.
"""

from __future__ import annotations

import torch

from batchgen.engine.sequence import Sequence


class RowPenalties:
    """One row's running token statistics, updated from its token ids as they grow.

    Sparse: a row touches the logits of the tokens it has seen (hundreds), never the whole
    vocabulary, as transformers' processors gather and scatter."""

    def __init__(self, seq: Sequence):
        self.params = params = seq.request.sampling
        self.num_counted = 0  # generated tokens already in `output_counts`
        self.output_counts: dict[int, int] = {}  # token id -> times generated
        # prompt and output tokens (repetition penalty only)
        self.seen: set[int] | None = set(seq.token_ids[:seq.num_prompt_tokens]) \
            if params.repetition_penalty != 1.0 else None
        # tensors of the above, rebuilt when they grow: (seen ids), (output ids, their counts)
        self._seen_ids: torch.Tensor | None = None
        self._output: tuple[torch.Tensor, torch.Tensor] | None = None
        self._token_controls: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def token_controls(self, vocab_size: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(allowed ids, biased ids, their biases) within the vocabulary, built once: they never change."""
        if self._token_controls is None or self._token_controls[0].device != device:
            p = self.params
            allowed = [t for t in p.allowed_token_ids if t < vocab_size]
            biased = [(t, b) for t, b in p.logit_bias if t < vocab_size]
            self._token_controls = (torch.tensor(allowed, dtype=torch.long, device=device),
                                    torch.tensor([t for t, _ in biased], dtype=torch.long, device=device),
                                    torch.tensor([b for _, b in biased], dtype=torch.float32, device=device))
        return self._token_controls

    def catch_up(self, seq: Sequence) -> None:
        """Count the tokens generated since the last step (token ids only grow, preempted or not)."""
        for token in seq.token_ids[seq.num_prompt_tokens + self.num_counted:]:
            self.output_counts[token] = self.output_counts.get(token, 0) + 1
            self._output = None
            if self.seen is not None and token not in self.seen:
                self.seen.add(token)
                self._seen_ids = None
            self.num_counted += 1

    def seen_ids(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        if self._seen_ids is None or self._seen_ids.device != device:
            self._seen_ids = torch.tensor(sorted(t for t in self.seen if t < vocab_size), dtype=torch.long,
                                          device=device)
        return self._seen_ids

    def output_deltas(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The output's token ids and what frequency and presence subtract from their logits."""
        if self._output is None or self._output[0].device != device:
            p = self.params
            counted = [(t, n) for t, n in self.output_counts.items() if t < vocab_size]
            ids = torch.tensor([t for t, _ in counted], dtype=torch.long, device=device)
            counts = torch.tensor([n for _, n in counted], dtype=torch.float32, device=device)
            self._output = ids, -(p.frequency_penalty * counts + p.presence_penalty)
        return self._output


class Penalties:
    """The rows with a logits control on, by seq_id; `apply` controls their logits rows."""

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)
        self._rows: dict[int, RowPenalties | None] = {}  # None until the row's first step

    def __bool__(self) -> bool:
        return bool(self._rows)

    def add(self, seq: Sequence) -> None:
        """Called when a request enters the engine; rows without a control are not tracked."""
        if seq.request.sampling.has_logits_controls:
            self._rows[seq.seq_id] = None  # built at its first step

    def release(self, seq: Sequence) -> None:
        self._rows.pop(seq.seq_id, None)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # logits: [num_seqs, vocab_size], row i belongs to seqs[i]; returns float32 logits (a copy)
        # exact for bf16/fp16 values: unpenalized rows keep their argmax
        # a copy even when float32 already (.float() would return the caller's tensor, changed in place)
        logits = logits.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        vocab_size, device = logits.shape[-1], logits.device
        masked: list[int] = []  # flat indices set to -inf (min_tokens)
        repeat_ids, repeat_rows, repeat_penalty = [], [], []  # per row: ids, row index, penalty
        output_ids, output_rows, output_delta = [], [], []
        allowed: list[tuple[int, torch.Tensor]] = []  # (row index, the ids it may draw)
        bias_ids, bias_rows, bias_values = [], [], []
        for i, seq in enumerate(seqs):
            if seq.seq_id not in self._rows:
                continue
            row = self._rows[seq.seq_id]
            if row is None:
                row = self._rows[seq.seq_id] = RowPenalties(seq)
            row.catch_up(seq)
            p = row.params
            if seq.num_generated_tokens < p.min_tokens:  # stop ids end a row as EOS does
                masked.extend(i * vocab_size + t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < vocab_size)
            if p.allowed_token_ids or p.logit_bias:
                allowed_ids, biased_ids, biases = row.token_controls(vocab_size, device)
                if p.allowed_token_ids:
                    allowed.append((i, allowed_ids))
                if biased_ids.numel():
                    bias_ids.append(biased_ids)
                    bias_rows.append(i)
                    bias_values.append(biases)
            if row.seen is not None:
                ids = row.seen_ids(vocab_size, device)
                repeat_ids.append(ids)
                repeat_rows.append(i)
                repeat_penalty.append(p.repetition_penalty)
            if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_counts:
                ids, delta = row.output_deltas(vocab_size, device)
                output_ids.append(ids)
                output_rows.append(i)
                output_delta.append(delta)
        flat = logits.view(-1)  # [num_seqs * vocab_size]
        if masked:
            flat.index_fill_(0, torch.tensor(masked, dtype=torch.long, device=device), float("-inf"))
        for i, ids in allowed:  # rare rows: one masked copy each
            kept = logits[i, ids]
            logits[i].fill_(float("-inf"))
            logits[i, ids] = kept
        if bias_ids:
            idx, _ = _flat_ids(bias_ids, bias_rows, vocab_size, device)
            flat.index_add_(0, idx, torch.cat(bias_values))
        if repeat_ids:
            idx, lengths = _flat_ids(repeat_ids, repeat_rows, vocab_size, device)
            penalty = torch.tensor(repeat_penalty, dtype=torch.float32, device=device).repeat_interleave(lengths)
            values = flat[idx]
            flat[idx] = torch.where(values > 0, values / penalty, values * penalty)
        if output_ids:
            idx, _ = _flat_ids(output_ids, output_rows, vocab_size, device)
            flat.index_add_(0, idx, torch.cat(output_delta))
        return logits


def _flat_ids(ids: list[torch.Tensor], rows: list[int], vocab_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token ids offset to its row of the flat logits, concatenated; and their counts."""
    lengths = torch.tensor([t.numel() for t in ids], dtype=torch.long, device=device)
    offsets = (torch.tensor(rows, dtype=torch.long, device=device) * vocab_size).repeat_interleave(lengths)
    return torch.cat(ids) + offsets, lengths
