"""Structured output in the sampler: each constrained row's grammar masks its logits, then advances.

llguidance (not xgrammar) does the grammar work. Measured on this machine with the embedded SmolLM2
tokenizer and a small JSON schema, it compiled faster, its masks cost far less than a forward
step, it ships as one wheel without torch, triton or other dependencies, and it knows when a
grammar is finished (nothing else can follow), which is when a row ends here.

State: one matcher per constrained row, keyed by sequence id and owned here. A grammar is compiled
once per constraint (a pristine matcher that rows deep-copy), so rows sharing a schema compile once.
The pristine matchers are kept least recently used first, up to MAX_COMPILED_BYTES of their estimated
size: a job of per-row schemas would otherwise keep one per distinct schema for its whole run, some
115 KiB each. One dropped is compiled again if a later row needs it; the rows running hold their
own copies.
A row's matcher holds exactly its generated tokens: preemption by recompute keeps the Sequence and
so the matcher; a continued row's earlier tokens are replayed into a fresh one when it is added.

Masks are filled by llguidance's batch executor, and the next step's are filled on a worker thread
while the next forward runs (engine/sampling/mask_prefetch.py; `overlap=False` fills them after
the forward, as a reference). Whether a row's grammar is finished is read when its token is
accepted and kept here, so that the engine's stop check never calls a matcher the worker holds.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from batchgen.config.constraint import Constraint, InvalidConstraint
from batchgen.engine.kernels.token_bitmask import apply_token_bitmask_
from batchgen.engine.sampling import jump_forward
from batchgen.engine.sampling.mask_prefetch import MaskPrefetch, fill_masks
from batchgen.engine.sequence import Sequence

log = logging.getLogger(__name__)

# on the CPU engine/kernels/token_bitmask.py writes -inf in place; elsewhere (and as the reference)
# a mask byte's value -> what its 8 tokens add to the logits (0 where the bit allows the token, -inf
# where it does not): bit i of byte k of mask word w allows token 32 * w + 8 * k + i, and the words
# are little-endian, so viewing them as bytes lists the tokens in order. One gather and one add:
# measured on this project's CPU machine at 16 rows of a 49k vocabulary, a third of the time of
# shifting out every bit and masked_fill with the result (the tokens' logits are unchanged but for
# -0.0, which becomes 0.0: equal under every comparison the sampler makes)
_BYTE_TO_ADDEND = torch.tensor([[0.0 if (value >> i) & 1 else float("-inf") for i in range(8)] for value in range(256)])
# the grammar engine's view of a tokenizer, per (HF tokenizer, vocab size): building it walks the whole
# vocabulary, and a job builds a new engine at each mode switch or fallback with the same tokenizer
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_COMPILED_BYTES = 64 << 20  # pristine matchers kept for reuse, by estimated_matcher_bytes
# a pristine llguidance 1.9 matcher's heap, measured (glibc mallinfo2) over JSON schemas of 1 to 80
# properties: about 128 KiB, plus about 70 bytes per character of its grammar's text, whatever the
# vocabulary (the tokenizer's tables are shared, not copied into each matcher)
_MATCHER_BASE_BYTES = 128 << 10
_MATCHER_BYTES_PER_GRAMMAR_CHAR = 72


@dataclass(frozen=True, slots=True)
class StepMasks:
    """A step's grammar masks: bitmask [logits rows, words] int32 (bit t % 32 of word t // 32 allows
    token t; rows of unconstrained rows all ones), and the logits rows it constrains, ascending."""

    bitmask: torch.Tensor
    constrained_rows: list[int]

    def word_rows(self) -> list[int]:
        """Per logits row, its bitmask row where it is constrained, else -1 (argmax_rows_masked's input)."""
        rows = [-1] * self.bitmask.shape[0]
        for r in self.constrained_rows:
            rows[r] = r
        return rows


def estimated_matcher_bytes(grammar: str) -> int:
    """The memory a pristine matcher of `grammar` (llguidance grammar text) holds, estimated."""
    return _MATCHER_BASE_BYTES + _MATCHER_BYTES_PER_GRAMMAR_CHAR * len(grammar)


def mask_threads(device: torch.device) -> int:
    """Threads that fill masks: one beside a CPU forward (its OpenMP threads have the cores), more
    beside a GPU's, where the host's cores are idle while the device computes."""
    return 1 if device.type == "cpu" else max(1, min(8, (os.cpu_count() or 2) // 2))


class GrammarMasks:
    def __init__(self, tokenizer, vocab_size: int, *, num_threads: int = 1, overlap: bool = True,
                 max_compiled_bytes: int = MAX_COMPILED_BYTES) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.num_threads = num_threads
        self.overlap = overlap  # fill the next step's masks during the forward (mask_prefetch.py)
        self._ll_tokenizer = None  # built on the first constrained row: unconstrained jobs never pay
        self._executor = None  # llguidance.LLExecutor, made with the first mask
        self._prefetch: MaskPrefetch | None = None
        self._table: torch.Tensor | None = None  # _BYTE_TO_ADDEND on the logits' device, in their dtype
        # constraint -> (a pristine llguidance matcher, its estimated bytes), least recently used first
        self._compiled: OrderedDict[Constraint, tuple[object, int]] = OrderedDict()
        self.max_compiled_bytes = max_compiled_bytes
        self.compiled_bytes = 0  # the estimated bytes of the matchers in _compiled
        self._matchers: dict[int, object] = {}  # seq_id -> that row's matcher
        self._stopped: set[int] = set()  # seq ids whose grammar is finished (read at accept, see above)
        self.num_compiled = 0
        self.num_prefetched_rows = 0  # masks taken from the background fill
        self.num_filled_rows = 0  # masks filled after the forward (rows new to the batch, overlap off)
        self._warned_min_tokens = False  # a grammar ended a row before its min_tokens (logged once)
        self.jump_forward = False  # engine/sampling/jump_forward.py; the engine sets its config's choice
        self.drafts: dict[int, list[int]] = {}  # seq id -> forced tokens found by the latest accept()
        self.max_model_len = 1 << 62  # the engine's: drafts stop short of it

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            by_vocab = _LL_TOKENIZERS.setdefault(self.hf_tokenizer, {})
            if self.vocab_size not in by_vocab:
                by_vocab[self.vocab_size] = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            self._ll_tokenizer = by_vocab[self.vocab_size]
        return self._ll_tokenizer

    def _executor_(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
            self._prefetch = MaskPrefetch(self._executor)
        return self._executor

    @property
    def background_s(self) -> float:
        """Seconds the worker spent filling masks (beside the forward, off the step's path)."""
        return 0.0 if self._prefetch is None else self._prefetch.background_s

    def compiled(self, constraint: Constraint):
        """The constraint's pristine matcher, compiled on first use or when it was dropped to keep
        the compiled ones within max_compiled_bytes (InvalidConstraint if it cannot be compiled)."""
        kept = self._compiled.get(constraint)
        if kept is not None:
            self._compiled.move_to_end(constraint)
            return kept[0]
        import llguidance

        grammar = constraint.grammar()
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        if matcher.is_error():
            raise InvalidConstraint(matcher.get_error())
        size = estimated_matcher_bytes(grammar)
        self._compiled[constraint] = (matcher, size)
        self.compiled_bytes += size
        self.num_compiled += 1
        while self.compiled_bytes > self.max_compiled_bytes and len(self._compiled) > 1:  # the newest stays
            _, (_, dropped) = self._compiled.popitem(last=False)
            self.compiled_bytes -= dropped
        return matcher

    def add(self, seq: Sequence) -> None:
        """A constrained row entered the engine: a fresh matcher that has seen its tokens so far."""
        constraint = seq.request.sampling.constraint
        assert constraint is not None
        matcher = self.compiled(constraint).deep_copy()
        for token in seq.generated_token_ids:  # a continuation's earlier tokens
            if not matcher.consume_token(token):
                log.warning("request %s: its continued tokens do not fit its constraint (%s)",
                            seq.request.request_id, matcher.get_error())
                break
        self._matchers[seq.seq_id] = matcher
        if matcher.is_stopped():
            self._stopped.add(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        # only forgotten here: a fill in flight may still hold the matcher, and drops it when done
        self._matchers.pop(seq.seq_id, None)
        self._stopped.discard(seq.seq_id)

    def stopped(self, seq: Sequence) -> bool:
        """The row's grammar is finished: it accepts and nothing else can follow."""
        return seq.seq_id in self._stopped

    def mask(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | None = None) -> torch.Tensor:
        """Logits with every token a row's grammar forbids at -inf (rows without one untouched).

        `positions[i]` (default 1) is how many consecutive logits rows seqs[i] has: a row with drafts
        (jump_forward.py) has one for its confirmed state and one after each of its first drafts."""
        step = self.masks(logits, seqs, positions)
        return logits if step is None else self.apply(logits, step)

    def masks(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | None = None
              ) -> StepMasks | None:
        """This step's bitmask, a row per logits row (as `mask`'s), and which rows it constrains;
        None where no row is constrained. A greedy step picks through it without a masked copy
        (engine/kernels/argmax.py's argmax_rows_masked); `apply` makes the copy for the others."""
        # logits: [sum(positions), vocab_size]
        executor = self._executor_()
        prefetched, filled = self._prefetch.take()  # joins the fill that ran beside this forward
        positions = positions or [1] * len(seqs)
        starts = list(itertools.accumulate(positions, initial=0))
        rows = [(starts[i], m, s) for i, (s, m) in enumerate(zip(seqs, positions, strict=True))
                if m and s.seq_id in self._matchers]
        if not rows:
            return None
        num_rows = starts[-1]
        bitmask = torch.full((num_rows, self._num_words()), -1, dtype=torch.int32)  # all allowed
        dst, src, missing = [], [], []
        for start, m, seq in rows:
            drafts = seq.token_ids[seq.num_confirmed_tokens:][:m - 1]
            hit = prefetched.get(seq.seq_id)
            num_confirmed = seq.num_confirmed_tokens - seq.num_prompt_tokens
            # filled for the state it is in, and for at least the drafts this chunk reached
            if hit is not None and hit[1] == num_confirmed and hit[2][:m - 1] == drafts:
                dst.extend(range(start, start + m))
                src.extend(range(hit[0], hit[0] + m))
            else:
                missing.append((self._matchers[seq.seq_id], start, drafts))
        if dst:  # index_copy_ with index tensors: list indexing (bitmask[dst] = ...) took tens of ms here
            bitmask.index_copy_(0, torch.tensor(dst), filled.index_select(0, torch.tensor(src)))
        if missing:
            fill_masks(executor, missing, bitmask)
        self.num_prefetched_rows += len(rows) - len(missing)
        self.num_filled_rows += len(missing)
        return StepMasks(bitmask, [r for start, m, _ in rows for r in range(start, start + m)])

    def apply(self, logits: torch.Tensor, step: StepMasks) -> torch.Tensor:
        """A copy of logits with -inf over the tokens `step` forbids each constrained row."""
        bitmask, constrained = step.bitmask, step.constrained_rows
        num_rows = bitmask.shape[0]
        if logits.device.type == "cpu":  # the C kernel writes -inf over the forbidden tokens of a copy
            masked = logits.clone()
            if apply_token_bitmask_(masked, bitmask.index_select(0, torch.tensor(constrained)), constrained):
                return masked
        # the packed words go to the logits' device and are unpacked there: 32x fewer bytes to copy
        device = logits.device
        bitmask = bitmask.to(device, non_blocking=True)
        table = self._addend_table(device, logits.dtype)
        addend = table[bitmask.view(torch.uint8).long()].reshape(num_rows, -1)  # [num_rows, 32 * num_words]
        width = logits.shape[1]
        if addend.shape[1] < width:  # logits past the grammar's vocabulary: only unconstrained rows keep them
            pad = torch.zeros(num_rows, width - addend.shape[1], dtype=table.dtype)
            pad.index_fill_(0, torch.tensor(constrained), float("-inf"))
            addend = torch.cat([addend, pad.to(device, non_blocking=True)], dim=1)
        return logits + addend[:, :width]

    def accept(self, seqs: list[Sequence], token_ids: list[int] | list[list[int]],
               pending: dict[int, list[int]] | None = None) -> list[int]:
        """Advance each constrained row's grammar by the tokens it was given this step (one int, or a
        list: drafts confirmed and the token picked after them), then start filling the next step's
        masks of the rows that go on (mask_prefetch.py). `pending`: rows whose chunk stopped short
        of their drafts, by seq id, with the drafts still to check. Jump-forward: the forced tokens
        of rows that go on are left in `self.drafts`. Returns how many of each row's tokens were
        consumed (fewer where its grammar finished first)."""
        executor = self._executor_()
        self._prefetch.take()  # mask() joined it already; a caller that skipped mask() must not race it
        self.drafts = {}
        pending = pending or {}
        lists = [t if isinstance(t, list) else [t] for t in token_ids]
        consumed = [len(t) for t in lists]
        rows = [(i, seq, matcher, tokens) for i, (seq, tokens) in enumerate(zip(seqs, lists, strict=True))
                if (matcher := self._matchers.get(seq.seq_id)) is not None and seq.seq_id not in self._stopped]
        if not rows:
            return consumed
        singles = [(matcher, tokens[0]) for _, _, matcher, tokens in rows if len(tokens) == 1]
        ok = iter(executor.consume_token_par(singles) if singles else [])
        next_rows = []
        for i, seq, matcher, tokens in rows:
            if len(tokens) == 1:
                fits = next(ok)
            else:
                consumed[i] = self._consume_until_stopped(matcher, tokens)
                fits = not matcher.is_error()
            if not fits:
                # only a token the mask left open is drawn; this means an empty mask (e.g. min_tokens masked EOS)
                log.warning("request %s: token %s does not fit its constraint (%s)", seq.request.request_id,
                            tokens, matcher.get_error())
            num_tokens = seq.num_confirmed_tokens - seq.num_prompt_tokens + consumed[i]  # appended after sampling
            if matcher.is_stopped():
                self._stopped.add(seq.seq_id)
                if num_tokens < seq.request.sampling.min_tokens and not self._warned_min_tokens:
                    self._warned_min_tokens = True  # once: every row of a job's constraint would repeat it
                    log.warning("request %s: its constraint is complete after %d tokens, before its min_tokens %d; "
                                "a finished constraint ends a row whatever min_tokens says (not logged again)",
                                seq.request.request_id, num_tokens, seq.request.sampling.min_tokens)
            elif num_tokens < seq.request.sampling.max_new_tokens:  # else the row ends this step
                drafts = pending.get(seq.seq_id)
                if drafts is None and self.jump_forward and jump_forward.eligible(seq):
                    drafts = jump_forward.forced_tokens(matcher, seq, num_tokens, self.max_model_len)
                    if drafts:
                        self.drafts[seq.seq_id] = drafts
                next_rows.append((seq.seq_id, num_tokens, matcher, drafts or []))
        if self.overlap:
            self._prefetch.start(next_rows, self._num_words())
        return consumed

    @staticmethod
    def _consume_until_stopped(matcher, tokens: list[int]) -> int:
        """Consume `tokens` in order, stopping where the grammar finishes (a token picked after a
        finishing draft is not the row's: step by step the row would have ended there)."""
        for n, token in enumerate(tokens):
            if matcher.is_stopped() or not matcher.consume_token(token):
                return n + (not matcher.is_stopped())  # an error: the token counts, as a single token's would
        return len(tokens)

    def _addend_table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if self._table is None or self._table.device != device or self._table.dtype != dtype:
            self._table = _BYTE_TO_ADDEND.to(device, dtype)
        return self._table

    def _num_words(self) -> int:
        return -(-self._tokenizer().vocab_size // 32)
