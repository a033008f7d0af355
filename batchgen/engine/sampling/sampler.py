"""Token sampling: greedy rows by argmax, every other row in one batched draw per step.

Greedy rows take csrc/argmax.c's first maximal index, so their text equals model.generate's. The
sampling rows go through engine/sampling/draw.py together: temperature, top-k, top-p and min-p as
per-row tensors, the token by Gumbel-max with a counter-based noise (engine/sampling/random_stream.py)
keyed by the row's seed and the index of the token in the row's own output. Nothing about a row's
randomness is stored: a preempted, recomputed or continued row draws what an uninterrupted one would,
and its text does not depend on which rows share its batch.

A request without a seed gets one from its request id (`derived_seed`), so a rerun draws the same;
a job always passes one, derived from the job's --seed and the row id (jobs/pipeline/core.py). The
samples of a request with n > 1 draw with `sample_seed(seed, i)`.
Repetition, presence and frequency penalties and min_tokens (engine/sampling/penalties.py) change the
logits of the rows that ask for them first; with none asked for, a step skips them entirely.
"""

from __future__ import annotations

import hashlib
import itertools

import torch

from batchgen.config.choices import MAX_LOGPROBS
from batchgen.engine.kernels.argmax import argmax_rows, argmax_rows_masked
from batchgen.engine.sampling import jump_forward
from batchgen.engine.sampling.draw import Drawn, RowControls, draw
from batchgen.engine.sampling.grammar import GrammarMasks, StepMasks
from batchgen.engine.sampling.logprobs import greedy_logprobs, sampled_logprobs
from batchgen.engine.sampling.penalties import Penalties
from batchgen.engine.sampling.random_stream import MASK64, splitmix64_int
from batchgen.engine.sequence import Sequence

# each sampling row's candidates: its largest logits, one topk over the batch (engine/sampling/draw.py)
DEFAULT_WINDOW = 256


def derived_seed(request_id: str) -> int:
    """The seed of a request that has none: stable across runs, batches and continuations."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request with sampling.n > 1, from the request's seed.

    Sample 0 keeps the seed, so its text is the one n = 1 gives; sample i > 0 draws with
    splitmix64(seed XOR splitmix64(i)) >> 1, a stream unrelated to every other key (vLLM's seed + i
    would make sample 1 of seed s the stream of sample 0 of seed s + 1, and a job's rows get
    consecutive-looking seeds from --seed). Like the seed, it depends on nothing else: each sample
    is reproducible, batch invariant and continued exactly.
    """
    if sample_index == 0:
        return seed
    return splitmix64_int((seed & MASK64) ^ splitmix64_int(sample_index)) >> 1


def _int64(seed: int) -> int:
    """The seed's low 64 bits as a signed int64 (a tensor element)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >> 63 else seed


class Sampler:
    def __init__(self, eos_token_ids: list[int] | None = None, window: int = DEFAULT_WINDOW) -> None:
        assert window >= MAX_LOGPROBS, window  # the window holds the alternatives logprobs list
        self.window = window
        self.penalties = Penalties(eos_token_ids or [])
        self.last_draw: Drawn | None = None  # the latest step's sampling rows (logprobs read it)
        # structured output (engine/sampling/grammar.py); set by the engine, which owns the tokenizer
        self.grammar: GrammarMasks | None = None
        self.num_refused_drafts = 0  # jump-forward drafts the model's own pick replaced (jump_forward.py)

    def add(self, seq: Sequence) -> None:
        """A request entered the engine (called once per sequence)."""
        self.penalties.add(seq)
        if seq.request.sampling.constraint is not None:  # structured-output hook
            assert self.grammar is not None, "a constrained request needs the engine's GrammarMasks"
            self.grammar.add(seq)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # logits: [num_seqs, vocab_size], row i belongs to seqs[i]
        # structured-output hook: constrained rows' forbidden tokens go to -inf before any pick, and
        # their grammars advance by the picked tokens; everything else is _pick's
        if not self.grammar:  # no constrained row running
            return self._pick(logits, seqs)
        step = self.grammar.masks(logits, seqs)
        tokens = self._greedy_masked(logits, step, seqs) if step is not None else None
        if tokens is None:
            tokens = self._pick(logits if step is None else self.grammar.apply(logits, step), seqs)
        self.grammar.accept(seqs, tokens)
        return tokens

    def _greedy_masked(self, logits: torch.Tensor, step: StepMasks, seqs: list[Sequence]) -> list[int] | None:
        """Every logits row's greedy pick among the tokens its grammar allows, read from the bitmask
        without a masked copy, where `_pick` would take plain argmax (greedy rows, no penalties, no
        logprobs); None otherwise, or where the kernel cannot run (then the copy is made)."""
        if self.penalties or any(not s.request.sampling.greedy or s.request.sampling.logprobs is not None
                                 for s in seqs):
            return None
        self.last_draw = None
        return argmax_rows_masked(logits, step.bitmask, step.word_rows())

    def sample_with_drafts(self, logits: torch.Tensor, rows: list[tuple[Sequence, int, bool]]
                           ) -> tuple[list[int], dict[int, tuple[int, int | None]]]:
        """A step where some rows have drafts (engine/sampling/jump_forward.py). rows: (sequence, its
        logits rows, whether it samples) in logits order; a row with drafts has one logits row per
        position its chunk reached from the one before its first draft. Returns the samplers' tokens
        (a row with drafts holds -1 there) and each row with drafts' verdict."""
        seqs = [seq for seq, _, _ in rows]
        step = self.grammar.masks(logits, seqs, [m for _, m, _ in rows])
        starts = list(itertools.accumulate((m for _, m, _ in rows), initial=0))
        plain = [i for i, (seq, _, _) in enumerate(rows) if not seq.num_draft_tokens]
        drafting = [i for i, (seq, _, _) in enumerate(rows) if seq.num_draft_tokens]
        drafted_rows = [r for i in drafting for r in range(starts[i], starts[i + 1])]
        # rows with drafts are greedy without controls (jump_forward.py's eligibility): one masked
        # argmax serves the whole step where the plain rows are greedy too
        every_row = None if step is None else self._greedy_masked(logits, step, [seqs[i] for i in plain])
        if every_row is not None:
            plain_tokens = [every_row[starts[i]] for i in plain]
            picked = iter([every_row[r] for r in drafted_rows])
        else:
            masked = logits if step is None else self.grammar.apply(logits, step)
            plain_tokens = self._pick(masked[_index([starts[i] for i in plain], masked.device)],
                                      [seqs[i] for i in plain])
            picked = iter(argmax_rows(masked[_index(drafted_rows, masked.device)]))
        given: dict[int, list[int]] = dict(zip(plain, ([t] for t in plain_tokens), strict=True))
        verdicts: dict[int, tuple[int, int | None]] = {}
        pending: dict[int, list[int]] = {}
        for i in drafting:
            seq = seqs[i]
            drafts = seq.token_ids[seq.num_confirmed_tokens:]
            num_accepted, token = jump_forward.verdict(drafts, [next(picked) for _ in range(rows[i][1])])
            verdicts[seq.seq_id] = (num_accepted, token)
            self.num_refused_drafts += token is not None and num_accepted < len(drafts)
            given[i] = drafts[:num_accepted] + ([] if token is None else [token])
            if token is None:
                pending[seq.seq_id] = drafts[num_accepted:]
        order = sorted(given)
        consumed = self.grammar.accept([seqs[i] for i in order], [given[i] for i in order], pending)
        for i, n in zip(order, consumed, strict=True):
            num_accepted, token = verdicts.get(seqs[i].seq_id, (None, None))
            if token is not None and n == num_accepted:  # the grammar finished with the drafts
                verdicts[seqs[i].seq_id] = (num_accepted, None)
                self.grammar.drafts.pop(seqs[i].seq_id, None)
        plain_iter = iter(plain_tokens)
        tokens = [-1 if seq.num_draft_tokens else next(plain_iter) for seq, _, samples in rows if samples]
        return tokens, verdicts

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # logits: [num_seqs, vocab_size], row i belongs to seqs[i]
        assert logits.shape[0] == len(seqs)
        self.last_draw = None
        if not seqs:
            return []
        if self.penalties:  # a dict check: nothing per row when no row asked for a penalty
            logits = self.penalties.apply(logits, seqs)
        sampling_rows = [i for i, s in enumerate(seqs) if not s.request.sampling.greedy]
        wants_logprobs = any(s.request.sampling.logprobs is not None for s in seqs)
        if not sampling_rows and not wants_logprobs:
            return argmax_rows(logits)  # the first maximal index, as HF's greedy picks
        device = logits.device
        out = [0] * len(seqs)
        greedy_rows = [i for i, s in enumerate(seqs) if s.request.sampling.greedy]
        if greedy_rows:
            greedy_logits = logits if not sampling_rows else logits[_index(greedy_rows, device)]
            greedy_tokens = argmax_rows(greedy_logits)
            for i, token in zip(greedy_rows, greedy_tokens, strict=True):
                out[i] = token
            if wants_logprobs:
                self._greedy_logprobs(greedy_logits, greedy_tokens, [seqs[i] for i in greedy_rows])
        if sampling_rows:
            if greedy_rows:
                logits = logits[_index(sampling_rows, device)]
            sampled = [seqs[i] for i in sampling_rows]
            drawn = draw(logits, self.controls(sampled, device), self.window, logprobs=wants_logprobs)
            self.last_draw = drawn
            for i, token in zip(sampling_rows, drawn.token_ids.tolist(), strict=True):  # the one device-to-host copy
                out[i] = token
            if wants_logprobs:
                rows = [r for r, s in enumerate(sampled) if s.request.sampling.logprobs is not None]
                if rows:
                    entries = sampled_logprobs(drawn, rows, [sampled[r].request.sampling.logprobs for r in rows])
                    for r, entry in zip(rows, entries, strict=True):
                        sampled[r].logprobs.append(entry)
        return out

    @staticmethod
    def _greedy_logprobs(logits: torch.Tensor, tokens: list[int], seqs: list[Sequence]) -> None:
        rows = [r for r, s in enumerate(seqs) if s.request.sampling.logprobs is not None]
        if not rows:
            return
        index = _index(rows, logits.device)
        entries = greedy_logprobs(logits[index], [tokens[r] for r in rows],
                                  [seqs[r].request.sampling.logprobs for r in rows])
        for r, entry in zip(rows, entries, strict=True):
            seqs[r].logprobs.append(entry)

    @staticmethod
    def controls(seqs: list[Sequence], device: torch.device) -> RowControls:
        """The sampling rows' settings as tensors (one small host-to-device copy each)."""
        params = [s.request.sampling for s in seqs]
        top_k = [p.top_k or 0 for p in params]
        return RowControls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor([_int64(sample_seed(p.seed if p.seed is not None else derived_seed(s.request.request_id),
                                                   s.sample_index))
                                for p, s in zip(params, seqs, strict=True)], dtype=torch.long, device=device),
            positions=torch.tensor([s.num_generated_tokens for s in seqs], dtype=torch.long, device=device),
            max_top_k=max(top_k), any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params))

    def release(self, seq: Sequence) -> None:
        self.penalties.release(seq)
        if self.grammar is not None:  # structured-output hook
            self.grammar.release(seq)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
