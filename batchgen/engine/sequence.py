"""Per-request state inside the engine. No torch: tested on plain ints.

A sequence has no prefill or decode phase. It has `num_tokens` (prompt + generated) and
`num_computed_tokens` (how many of them have their K/V in the cache); each step the scheduler
gives it some of the difference. It samples a token only in a step that brings the two level.

    | <-- computed (K/V cached) --> | <-- scheduled this step --> | <-- still to compute --> |
    0                     num_computed_tokens                                      num_tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from batchgen.engine.request import FinishReason, Request, TokenLogprob


@dataclass(slots=True)
class GroupBlocks:
    """A sequence's blocks in one more KV layer group (kv/groups.py: a local/global model's sliding
    layers have their own): the four block fields a Sequence has for its first group."""

    block_table: list[int] = field(default_factory=list)
    num_dropped_blocks: int = 0
    num_hashed_blocks: int = 0
    block_hashes: list[int] = field(default_factory=list)


class SequenceStatus(Enum):
    WAITING = auto()  # not admitted yet, or preempted (holds no blocks)
    RUNNING = auto()  # holds blocks, gets tokens scheduled
    FINISHED = auto()  # done; blocks returned


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)  # physical block ids, in token order
    # its first blocks that fell out of the sliding window of every layer and went back to the pool
    # (kv/block_manager.py, drop_out_of_window): their entries stay in block_table as DROPPED_BLOCK
    num_dropped_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # the same four fields for each further KV layer group (kv/hybrid.py); empty with one group
    kv_groups: list[GroupBlocks] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # full blocks of this sequence already registered in the prefix cache (a prefix of block_table)
    num_hashed_blocks: int = 0
    # hash of each registered full block, chained: hash i covers tokens [0, (i+1)*block_size)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    # static policy: ran past its predicted length, so its next reservation is the full maximum
    num_overruns: int = 0
    # static policy: its blocks cover a predicted length only; outgrowing them parks it
    reserved_for_prediction: bool = False
    # steps that left its prompt for the next step rather than split it (scheduler.MAX_PREFILL_DEFERRALS)
    num_prefill_deferrals: int = 0
    # requests with logprobs: one per generated token of this attempt (the sampler appends them)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # a sample of a request with sampling.n > 1 other than its first: the sibling whose prompt blocks
    # it shares (scheduler.py, "Samples of one request"); None for a first sample or n == 1
    # or a row whose prompt starts as this one's does (Request.prefix_leader_id)
    prompt_leader: Sequence | None = None
    # the prompt tokens it shares with its prompt_leader; None: its whole prompt (a sample)
    num_leader_tokens: int | None = None
    # > 0 while it holds its leader's prompt blocks before the leader has computed them: it is not
    # scheduled until the leader's num_computed_tokens reaches this
    awaits_leader_tokens: int = 0
    # jump-forward (engine/sampling/jump_forward.py): the grammar's forced tokens at the tail of
    # token_ids, run through the next forward but not yet confirmed as the tokens the model picks
    num_draft_tokens: int = 0

    @classmethod
    def from_request(cls, seq_id: int, request: Request) -> Sequence:
        assert len(request.prompt_token_ids) >= 1, "a prompt needs at least one token"
        # a continued row starts with its earlier tokens already generated: its first step
        # prefills them with the prompt (the same path a preempted sequence takes to recompute)
        generated = request.continuation.token_ids if request.continuation is not None else ()
        return cls(seq_id=seq_id, request=request, token_ids=[*request.prompt_token_ids, *generated],
                   num_prompt_tokens=len(request.prompt_token_ids))

    @property
    def sample_index(self) -> int:
        return self.request.sample_index or 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_confirmed_tokens(self) -> int:
        """Tokens but the unconfirmed drafts: what a checkpoint keeps and a grammar has consumed."""
        return len(self.token_ids) - self.num_draft_tokens

    @property
    def confirmed_output_ids(self) -> list[int]:
        """Generated tokens but unconfirmed drafts: what a checkpoint keeps (a continuation checks
        the drafts again)."""
        return self.token_ids[self.num_prompt_tokens:self.num_confirmed_tokens]

    @property
    def first_logits_position(self) -> int:
        """The first position whose logits this sequence needs: the one before its first draft
        (each draft is checked against the token the model picks there), else its last token."""
        return len(self.token_ids) - self.num_draft_tokens - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most tokens this request may generate."""
        return self.num_prompt_tokens + self.request.sampling.max_new_tokens

    def num_tokens_to_reserve(self, max_model_len: int) -> int:
        """Static policy: how many token slots to reserve when this sequence is admitted."""
        full = min(self.max_num_tokens, max_model_len)
        predicted = self.request.predicted_num_output_tokens
        if predicted is None or self.num_overruns:
            return full
        # at least one slot past what is already computed, so the sequence can always advance
        return max(min(self.num_prompt_tokens + max(predicted, 1), full), min(self.num_tokens + 1, full))

    def append_token(self, token_id: int) -> None:
        assert self.status is SequenceStatus.RUNNING
        assert self.num_computed_tokens == len(self.token_ids), "sampled before catching up"
        self.token_ids.append(token_id)

    def add_drafts(self, token_ids: list[int]) -> None:
        """The grammar's forced tokens after the token just sampled: the next chunk runs them."""
        if not token_ids:
            return
        assert self.num_draft_tokens == 0 and self.num_computed_tokens == len(self.token_ids) - 1
        self.token_ids.extend(token_ids)
        self.num_draft_tokens = len(token_ids)

    def drop_drafts(self) -> None:
        """Forget the unconfirmed drafts (a preempted or finished row): its grammar never consumed them."""
        del self.token_ids[len(self.token_ids) - self.num_draft_tokens:]
        self.num_draft_tokens = 0
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))

    def settle_drafts(self, num_accepted: int, token_id: int | None) -> None:
        """A step's verdict on the drafts its chunk reached: the first `num_accepted` are the model's
        own picks; `token_id`, if any, is the token picked after them (at the end of the sequence, or
        in place of the first refused draft, whose tail is then dropped with its K/V)."""
        assert 0 <= num_accepted <= self.num_draft_tokens
        self.num_draft_tokens -= num_accepted
        if token_id is None:
            assert self.num_computed_tokens <= len(self.token_ids) - self.num_draft_tokens
            return
        cut = len(self.token_ids) - self.num_draft_tokens
        del self.token_ids[cut:]
        self.num_draft_tokens = 0
        self.num_computed_tokens = min(self.num_computed_tokens, cut)
        self.token_ids.append(token_id)
