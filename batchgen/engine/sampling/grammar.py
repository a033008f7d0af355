"""Structured output in the sampler: each constrained row's grammar masks its logits, then advances.

llguidance (not xgrammar) does the grammar work. Measured on this machine with the embedded SmolLM2
tokenizer and a small JSON schema, it compiled faster, its masks cost far less than a forward
step, it ships as one wheel without torch, triton or other dependencies, and it knows when a
grammar is finished (nothing else can follow), which is when a row ends here.

State: one matcher per constrained row, keyed by sequence id and owned here. A grammar is compiled
once per constraint (a pristine matcher that rows deep-copy), so rows sharing a schema compile once.
A row's matcher holds exactly its generated tokens: preemption by recompute keeps the Sequence and
so the matcher; a continued row's earlier tokens are replayed into a fresh one when it is added.
"""

from __future__ import annotations

import logging
import weakref

import torch

from batchgen.config.constraint import Constraint, InvalidConstraint
from batchgen.engine.scheduler.sequence import Sequence

log = logging.getLogger(__name__)

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit i of a mask word allows token 32 * word + i
# the grammar engine's view of a tokenizer, per (HF tokenizer, vocab size): building it walks the whole
# vocabulary, and a job builds a new engine at each mode switch or fallback with the same tokenizer
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GrammarMasks:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._ll_tokenizer = None  # built on the first constrained row: unconstrained jobs never pay
        self._compiled: dict[Constraint, object] = {}  # constraint -> a pristine llguidance matcher
        self._matchers: dict[int, object] = {}  # seq_id -> that row's matcher
        self.num_compiled = 0

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

    def compiled(self, constraint: Constraint):
        """The constraint's pristine matcher, compiled on first use (InvalidConstraint if it cannot be)."""
        matcher = self._compiled.get(constraint)
        if matcher is None:
            import llguidance

            matcher = llguidance.LLMatcher(self._tokenizer(), constraint.grammar())
            if matcher.is_error():
                raise InvalidConstraint(matcher.get_error())
            self._compiled[constraint] = matcher
            self.num_compiled += 1
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

    def release(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def stopped(self, seq: Sequence) -> bool:
        """The row's grammar is finished: it accepts and nothing else can follow."""
        matcher = self._matchers.get(seq.seq_id)
        return matcher is not None and matcher.is_stopped()

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Logits with every token a row's grammar forbids at -inf (rows without one untouched)."""
        # logits: [num_seqs, vocab_size]
        rows = [(i, self._matchers[s.seq_id]) for i, s in enumerate(seqs) if s.seq_id in self._matchers]
        if not rows:
            return logits
        import llguidance.torch as lt

        num_words = -(-self._tokenizer().vocab_size // 32)
        bitmask = torch.full((len(seqs), num_words), -1, dtype=torch.int32)  # all allowed
        for i, matcher in rows:
            lt.fill_next_token_bitmask(matcher, bitmask, i)
        # the packed words go to the logits' device and are unpacked there: 32x fewer bytes to copy
        device = logits.device
        bitmask = bitmask.to(device, non_blocking=True)
        shifts = _BIT_SHIFTS if device.type == "cpu" else _BIT_SHIFTS.to(device, non_blocking=True)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(seqs), -1)
        width = logits.shape[1]
        if allowed.shape[1] < width:  # logits past the grammar's vocabulary: only unconstrained rows keep them
            pad = torch.ones(len(seqs), width - allowed.shape[1], dtype=torch.bool)
            pad[[i for i, _ in rows]] = False
            allowed = torch.cat([allowed, pad.to(device, non_blocking=True)], dim=1)
        return logits.masked_fill(~allowed[:, :width], float("-inf"))

    def accept(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Advance each constrained row's grammar by the token it was given this step."""
        for seq, token in zip(seqs, token_ids, strict=True):
            matcher = self._matchers.get(seq.seq_id)
            if matcher is not None and not matcher.is_stopped() and not matcher.consume_token(token):
                # only a token the mask left open is drawn; this means an empty mask (e.g. min_tokens masked EOS)
                log.warning("request %s: token %d does not fit its constraint (%s)", seq.request.request_id,
                            token, matcher.get_error())
