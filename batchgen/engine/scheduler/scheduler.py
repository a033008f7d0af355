"""Which sequences run in the next step, and how many tokens each. No torch.

Continuous policy (iteration-level scheduling, after vLLM v1): every step starts with a token
budget. Running sequences are served first, oldest first, each `min(uncomputed, budget)` tokens
(a long prompt is thus prefilled in chunks). When a sequence needs a block and none is free, the
newest running sequence is preempted (its blocks freed, recomputed later). Then waiting sequences
are admitted while the budget, `max_num_seqs` and free blocks allow. A finished sequence frees
its blocks the step it finishes.

A prompt that fits one step whole but not the budget this step has left waits for the next step
(at most MAX_PREFILL_DEFERRALS times) instead of being split, so that it is prefilled in one causal
pass: a split prompt's tail chunk has to read its head's K/V back out of the pages, and on the SDPA
path (CUDA without flash-attn, CPUs or head sizes without the C prefill kernel) it attends over
the gathered context with an explicit mask rather than with causal attention in one piece. Shorter
prompts behind it fill the budget it leaves (first fit), so steps stay full.

Static policy: a batch is admitted only when nothing is running; each member reserves blocks for
its whole prompt + max_new_tokens up front (or prompt + a planner's predicted output length), so
the batch never preempts, and it runs until its last member finishes. A member that outgrows a
predicted reservation is parked at the back of the queue with its tokens, and finished in a
later batch with a full reservation: never cut short, never taking a batch-mate's memory.

Samples of one request (sampling.n > 1) share their prompt's blocks; which sample waits for which,
and when, is samples.py's rule. Both admissions skip a sample that must wait and go on down the queue.
"""

from __future__ import annotations

from collections import deque

from batchgen.config.choices import Policy
from batchgen.engine.kv.block_manager import BlockManager
from batchgen.engine.request import FinishReason
from batchgen.engine.scheduler import samples
from batchgen.engine.scheduler.output import ScheduledSeq, SchedulerOutput
from batchgen.engine.sequence import Sequence, SequenceStatus

# how many steps one prompt may wait rather than be split; bounds the delay when decode tokens keep
# the budget from ever holding it whole
MAX_PREFILL_DEFERRALS = 2


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: Policy = Policy.CONTINUOUS):
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = Policy(policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is the newest
        # keep a few blocks free at admission so running sequences can grow without preempting
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        self.num_preemptions = 0
        self.num_overruns = 0
        self.pins = samples.LeaderPins()  # finished leaders' blocks that waiting siblings start from

    # ---- queue -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        self.waiting.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy is Policy.STATIC and not self.running:
            self._admit_static_batch(out)
        budget = self._schedule_running(out, budget)
        if self.policy is Policy.STATIC and not self.running and self.waiting:
            # every member of the batch overran and was parked: start the next batch now
            self._admit_static_batch(out)
            budget = self._schedule_running(out, budget)
        if self.policy is Policy.CONTINUOUS and out.num_preempted == 0:
            self._admit_waiting(out, budget)
        self.pins.release_unneeded(self.waiting, self.block_manager)  # the siblings admitted hold their own
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if samples.awaiting(seq):
                i += 1  # its leader computes the prompt blocks it shares first
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            assert num_new >= 1
            if self._defer_split(seq, num_new, budget):
                i += 1  # first fit: a shorter prompt or a decode behind it takes the budget
                continue
            target = seq.num_computed_tokens + num_new
            if seq.reserved_for_prediction and bm.blocks_needed(seq, target):
                self._park_overrun(seq)  # past its reservation: finish it in a later batch
                out.num_overruns += 1
                continue
            scheduled = True
            while not bm.can_allocate(seq, target):
                if self.pins.release_all(bm):
                    continue
                victim = self.running[-1]
                if victim is seq:
                    if len(self.running) == 1:
                        # alone and still out of blocks: the cache cannot hold this sequence.
                        # Release it like a waiting sequence that can never fit: no blocks, in no
                        # queue, so the caller's finish() has nothing left to free or dequeue.
                        self.running.pop()
                        self.block_manager.free(seq)
                        seq.status = SequenceStatus.WAITING
                        out.out_of_memory.append(seq)
                    else:
                        self._preempt(seq)
                        out.num_preempted += 1
                    scheduled = False
                    break
                self._preempt(victim)
                out.num_preempted += 1
            if not scheduled:
                break
            bm.allocate(seq, target)
            out.scheduled.append(ScheduledSeq(seq, num_new, target == seq.num_tokens))
            budget -= num_new
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            cached, awaits = samples.prefix_for(seq, bm)
            if cached is None:
                i += 1  # a sample whose leader has not got the prompt's blocks yet: the rows behind it go on
                continue
            num_cached_tokens = len(cached) * bm.block_size
            num_new = min(seq.num_tokens - num_cached_tokens, budget)
            if not awaits and self._defer_split(seq, num_new, budget, seq.num_tokens - num_cached_tokens):
                break  # admitted first next step, in queue order
            # the watermark keeps room for running sequences to grow; with none running it
            # would only stop a sequence that fits from ever starting
            watermark = self.watermark_blocks if self.running else 0
            if not bm.can_admit(seq, cached, num_new, watermark_blocks=watermark):
                if not self.running and self.pins.release_all(bm):
                    continue  # the same row again, with the pinned blocks back in the pool
                if not self.running:
                    # nothing runs and it still cannot start: it can never run
                    del self.waiting[i]
                    out.out_of_memory.append(seq)
                    continue
                break
            del self.waiting[i]
            bm.admit(seq, cached, num_new)
            self._start(seq, num_cached_tokens)
            if awaits:  # shares blocks its leader computes in this step: it runs from the next
                seq.awaits_leader_tokens = num_cached_tokens
                continue
            samples_now = seq.num_computed_tokens + num_new == seq.num_tokens
            out.scheduled.append(ScheduledSeq(seq, num_new, samples_now))
            budget -= num_new

    def _defer_split(self, seq: Sequence, num_new: int, budget: int, num_left: int | None = None) -> bool:
        """Leave this prompt whole for the next step rather than split it here (module docstring)?
        Only a prompt that an empty step would hold, only when this step already has work, and
        at most MAX_PREFILL_DEFERRALS times per sequence."""
        num_left = seq.num_uncomputed_tokens if num_left is None else num_left
        if num_new >= num_left or num_left > self.max_num_batched_tokens or budget == self.max_num_batched_tokens:
            return False
        if seq.num_prefill_deferrals >= MAX_PREFILL_DEFERRALS:
            return False
        seq.num_prefill_deferrals += 1
        return True

    def _admit_static_batch(self, out: SchedulerOutput) -> None:
        """Admit up to max_num_seqs waiting sequences, each with its full final size reserved."""
        bm = self.block_manager
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            cached, awaits = samples.prefix_for(seq, bm)
            if cached is None:
                i += 1  # its leader is not in this batch (yet): it waits for it
                continue
            reserve = seq.num_tokens_to_reserve(self.max_model_len)
            chunk = self.max_num_batched_tokens
            fully_reserved = bm.can_admit(seq, cached, 0, reserve_tokens=reserve, chunk_tokens=chunk)
            if not fully_reserved:
                if self.running:
                    break
                if self.pins.release_all(bm):
                    continue  # the same row again, with the pinned blocks back in the pool
                # alone it does not fit either: run it with what there is (it stops at "length")
                reserve = seq.num_tokens
                if not bm.can_admit(seq, cached, 0, reserve_tokens=reserve, chunk_tokens=chunk):
                    # even its tokens so far do not fit the whole cache (it grew past it in an
                    # earlier batch): it can never run again
                    del self.waiting[i]
                    out.out_of_memory.append(seq)
                    continue
            del self.waiting[i]
            bm.admit(seq, cached, 0, reserve_tokens=reserve, chunk_tokens=chunk)
            self._start(seq, len(cached) * bm.block_size)
            if awaits:
                seq.awaits_leader_tokens = len(cached) * bm.block_size
            seq.reserved_for_prediction = fully_reserved and reserve < min(seq.max_num_tokens, self.max_model_len)
            if not fully_reserved:
                # it grows into blocks it has not reserved: batch-mates would be preempted for
                # them, so it runs alone
                break

    def _start(self, seq: Sequence, num_cached_tokens: int) -> None:
        if seq.num_preemptions == 0 and seq.num_overruns == 0:  # its first admission
            seq.num_cached_prompt_tokens = num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def preempt_all(self) -> int:
        """Release every running sequence to the front of the queue, oldest first (their tokens stay:
        they are recomputed when readmitted). The engine's recovery from a device OOM."""
        running = list(self.running)
        for seq in reversed(running):  # the newest goes to the front first, so the oldest ends up first
            if seq.status is SequenceStatus.RUNNING:  # not requeued already with its leader
                self._preempt(seq)
        return len(running)

    def set_block_manager(self, block_manager: BlockManager) -> None:
        """Swap in a rebuilt (e.g. smaller) KV block pool; nothing may hold blocks of the old one."""
        assert not self.running
        self.pins.drop()  # held in the old pool
        self.block_manager = block_manager
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    def _park_overrun(self, seq: Sequence) -> None:
        seq.reserved_for_prediction = False
        seq.num_overruns += 1
        self.num_overruns += 1
        # behind the rows not yet started, which keep their batch order
        self._release_to_waiting(seq, front=False)

    def _preempt(self, seq: Sequence) -> None:
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._release_to_waiting(seq, front=True)  # first to come back

    def _release_to_waiting(self, seq: Sequence, *, front: bool) -> None:
        """Drop a running sequence's K/V (its tokens stay: they are recomputed on return), and the
        K/V of samples that share its prompt blocks before it computed them (samples.py)."""
        for sibling in self._awaiting(seq):
            self._release_to_waiting(sibling, front=front)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.drop_drafts()  # unconfirmed: a prefix-cache hit on them would skip the logits that check them
        seq.num_computed_tokens = 0
        seq.awaits_leader_tokens = 0
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _awaiting(self, seq: Sequence) -> list[Sequence]:
        """Running samples that share `seq`'s prompt blocks before it computed them (samples.py)."""
        return [s for s in self.running if s.awaits_leader_tokens and s.prompt_leader is seq]

    # ---- after the forward ---------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled_token_ids: list[int],
               verdicts: dict[int, tuple[int, int | None]] | None = None,
               drafts: dict[int, list[int]] | None = None) -> list[Sequence]:
        """Advance computed counts, register full blocks, append sampled tokens; returns the
        sequences that gained tokens. `sampled_token_ids` is in `out.samplers` order. Jump-forward
        (engine/sampling/jump_forward.py): `verdicts` (seq id -> drafts confirmed, token picked after
        them) settle the drafts of the rows that have some, in place of their sampled entry;
        `drafts` (seq id -> forced tokens) follow a row's new token."""
        verdicts = verdicts or {}
        samplers = out.samplers
        assert len(samplers) == len(sampled_token_ids)
        grown = []
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            assert seq.num_computed_tokens <= seq.num_tokens
            verdict = verdicts.get(seq.seq_id)
            if verdict is not None:  # before caching blocks: only confirmed tokens stay computed
                seq.settle_drafts(*verdict)
                if verdict[0] or verdict[1] is not None:
                    grown.append(seq)
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.drop_out_of_window(seq)
        for seq, token_id in zip(samplers, sampled_token_ids, strict=True):
            if seq.seq_id not in verdicts:
                seq.append_token(token_id)
                grown.append(seq)
        if drafts:
            for seq in grown:
                seq.add_drafts(drafts.get(seq.seq_id, []))
        return grown

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        for sibling in self._awaiting(seq):  # samples.py: it computed their blocks, unless it never ran
            if samples.wrote(seq, sibling.awaits_leader_tokens):
                sibling.awaits_leader_tokens = 0
            else:
                self._release_to_waiting(sibling, front=True)
        if seq.status is SequenceStatus.RUNNING:
            self.pins.hold(seq, self.waiting, self.block_manager)
            self.running.remove(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        bs = self.block_manager.block_size
        assert len(self.running) <= self.max_num_seqs
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            assert seq.num_computed_tokens <= seq.num_tokens
            samples.check_awaiting(seq, bs)
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert not seq.block_table and seq.num_computed_tokens == 0 and not seq.awaits_leader_tokens
            assert not any(g.block_table for g in seq.kv_groups)
        ids = [s.seq_id for s in self.running] + [s.seq_id for s in self.waiting]
        assert len(ids) == len(set(ids)), "a sequence is queued twice"
        self.block_manager.check_integrity(self.running)
