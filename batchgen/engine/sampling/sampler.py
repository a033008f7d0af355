"""Token sampling: greedy, temperature, top-k, top-p, min-p, each row with its own seeded generator.

A row's random stream belongs to the row alone (seeded from its SamplingParams.seed and
advanced once per sampled token), so its text does not depend on which rows share its batch.
Repetition, presence and frequency penalties and min_tokens (engine/sampling/penalties.py) change the
logits of the rows that ask for them first; with none asked for, a step skips them entirely.
"""

from __future__ import annotations

import random

import torch

from batchgen.engine.kernels.argmax import argmax_rows
from batchgen.engine.sampling.penalties import Penalties
from batchgen.engine.scheduler.sequence import Sequence


class Sampler:
    def __init__(self, eos_token_ids: list[int] | None = None) -> None:
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> its private stream
        self.penalties = Penalties(eos_token_ids or [])

    def add(self, seq: Sequence) -> None:
        """A request entered the engine (called once per sequence)."""
        self.penalties.add(seq)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # logits: [num_seqs, vocab_size], row i belongs to seqs[i]
        assert logits.shape[0] == len(seqs)
        if not seqs:
            return []
        if self.penalties:  # a dict check: nothing per row when no row asked for a penalty
            logits = self.penalties.apply(logits, seqs)
        greedy = argmax_rows(logits)  # the first maximal index, as HF's greedy picks
        if all(s.request.sampling.greedy for s in seqs):
            return greedy
        out = []
        for i, seq in enumerate(seqs):
            params = seq.request.sampling
            if params.greedy:
                out.append(greedy[i])
                continue
            row = logits[i].float().cpu() / params.temperature
            row = _top_k_top_p(row, params.top_k, params.top_p)
            if params.min_p > 0.0:
                row = _min_p(row, params.min_p)
            probs = torch.softmax(row, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(seq)).item()))
        return out

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            seed = seq.request.sampling.seed
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else random.getrandbits(63))
            continuation = seq.request.continuation
            if continuation is not None and continuation.rng_state is not None:
                # where the stopped attempt left this row's stream: the next draw is the one an
                # uninterrupted run would make
                gen.set_state(torch.frombuffer(bytearray(continuation.rng_state), dtype=torch.uint8))
            self._generators[seq.seq_id] = gen
        return gen

    def rng_state(self, seq: Sequence) -> bytes | None:
        """The row's generator state now (for a checkpoint between steps); None for a greedy row."""
        if seq.request.sampling.greedy:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:  # nothing sampled in this attempt yet: the state it was given still holds
            continuation = seq.request.continuation
            return continuation.rng_state if continuation is not None else None
        return gen.get_state().numpy().tobytes()

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self.penalties.release(seq)


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's min_p: after temperature (and top-k/top-p), drop every token whose probability is
    below min_p times the likeliest token's; the likeliest always stays."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    # logits: [vocab_size]; masked entries become -inf
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits
