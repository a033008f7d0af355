"""Samples of one request (sampling.n > 1), and rows that share a prompt prefix: the shared prompt
is computed once, its K/V blocks shared. No torch.

The engine makes one sequence per sample; the first is the leader, the others point at it
(`Sequence.prompt_leader`). A row whose request names a prefix leader (Request.prefix_leader_id: the
job's planner groups rows that share a document, jobs/planning/prefix_groups.py) points at that
row's sequence the same way, for the full blocks of their common prompt prefix
(`Sequence.num_leader_tokens`); "sibling" below means either. A sibling is admitted with the
leader's blocks of the shared full blocks as its prefix (the block manager's ref counts share them;
the same admission a prefix-cache hit takes), and computes only the rest of its prompt (a sample:
the last, partial block) and its own tokens: never fewer than one token, which gives it the logits
of its first draw. The rule each admission follows:

    leader finished, or the prefix cache already holds the prompt   -> the usual prefix-cache lookup
    leader waiting, or running without all those blocks yet         -> the sibling waits (skipped,
                                                                       the queue behind it goes on)
    leader running with the blocks (computed or not)                -> fork: share them

A fork taken before the leader has computed the blocks (a static batch admits every member at once;
a continuous step admits the leader and its siblings together) leaves the sibling admitted but
unscheduled until the leader's num_computed_tokens covers them (`awaits_leader_tokens`). If the
leader loses its blocks first (preempted, parked or requeued after an OOM), such a sibling goes back
to the queue with it (Scheduler._release_to_waiting): the blocks it shares were never written.
A sibling that has started owns its references: the leader's preemption or end costs it nothing.
A pool of several KV layer groups (kv/hybrid.py, local/global models) does not fork: a sibling there
takes what the prefix cache holds of the prompt once its leader has registered it, else computes it.

A leader that finishes while siblings still wait in the queue (the batch was full, or a static
batch ended) leaves its shared blocks pinned in the prefix cache (`LeaderPins`) until no sibling
waits on it any more, so newer cached blocks are evicted before a waiting sibling's prefix. Pins
give way where memory is short: before a running row is preempted, or a row declared out of memory.

Forking copies no K/V and needs no copy-on-write: the shared blocks are full prompt blocks, which no
sample ever writes again; each sample's partial last block is its own. Preemption, chunked prefill,
continuations (a continued sample shares the prompt's blocks and recomputes its own tokens) and both
policies keep working because a sibling is an ordinary sequence once admitted.
"""

from __future__ import annotations

from collections.abc import Iterable

from batchgen.engine.kv.block_manager import BlockManager
from batchgen.engine.sequence import Sequence, SequenceStatus


def num_shared_blocks(seq: Sequence, block_size: int) -> int:
    """The prompt's full blocks a sample may take from its leader (its last token is always computed)."""
    shared = seq.num_prompt_tokens if seq.num_leader_tokens is None else seq.num_leader_tokens
    return min(shared, seq.num_tokens - 1) // block_size


def prefix_for(seq: Sequence, bm: BlockManager) -> tuple[list[int] | None, bool]:
    """(the blocks `seq` starts with, whether it must await its leader computing them); (None, False):
    not admissible yet, its leader has not got the prompt's blocks."""
    cached = bm.find_cached_prefix(seq)
    leader = seq.prompt_leader
    if leader is None or leader.status is SequenceStatus.FINISHED:
        return cached, False
    num_blocks = num_shared_blocks(seq, bm.block_size)
    if len(cached) >= num_blocks or not bm.forks_samples:
        return cached, False
    if leader.num_dropped_blocks:  # sliding window: its first blocks are gone
        return cached, False
    if leader.status is SequenceStatus.WAITING or len(leader.block_table) < num_blocks:
        return None, False
    return leader.block_table[:num_blocks], not wrote(leader, num_blocks * bm.block_size)


def wrote(leader: Sequence, num_tokens: int) -> bool:
    """Whether `leader` has written the K/V of its first `num_tokens` tokens. A leader that itself
    awaits its own leader (a chain: a row's samples following a row that follows a document's first
    row) counts tokens as computed that nobody has written yet."""
    return leader.num_computed_tokens >= num_tokens and not awaiting(leader)


def awaiting(seq: Sequence) -> bool:
    """Admitted with its leader's blocks, which are not written yet (`wrote`): skip it this step.
    Clears the mark once they are."""
    if not seq.awaits_leader_tokens:
        return False
    assert seq.prompt_leader is not None and seq.prompt_leader.status is SequenceStatus.RUNNING
    if not wrote(seq.prompt_leader, seq.awaits_leader_tokens):
        return True
    seq.awaits_leader_tokens = 0
    return False


def check_awaiting(seq: Sequence, block_size: int) -> None:
    """The invariant of an awaiting sibling (Scheduler.check_integrity)."""
    if not seq.awaits_leader_tokens:
        return
    leader = seq.prompt_leader
    assert leader is not None and leader.status is SequenceStatus.RUNNING, seq.seq_id
    num_blocks = seq.awaits_leader_tokens // block_size
    if not leader.num_dropped_blocks:  # once the leader computed them, its window may have dropped some
        assert seq.block_table[:num_blocks] == leader.block_table[:num_blocks], seq.seq_id
    assert seq.num_computed_tokens == seq.awaits_leader_tokens, seq.seq_id


def follow_prefix(seq: Sequence, leader: Sequence | None, block_size: int) -> None:
    """Start `seq` from its prefix leader's blocks, if that row is still here and they share a full one."""
    if leader is None or leader.status is SequenceStatus.FINISHED:
        return
    if leader.request.adapter != seq.request.adapter:  # another LoRA adapter's K/V differ for the same tokens
        return
    num_common = num_common_tokens(leader.token_ids[:leader.num_prompt_tokens], seq.token_ids[:seq.num_prompt_tokens])
    if num_common >= block_size:
        seq.prompt_leader, seq.num_leader_tokens = leader, num_common


def num_common_tokens(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (binary search over slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class LeaderPins:
    """The shared blocks of finished leaders, held while siblings that start from them still wait."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[Sequence, list[int]]] = {}  # leader seq_id -> (leader, its pinned blocks)

    def hold(self, leader: Sequence, waiting: Iterable[Sequence], bm: BlockManager) -> None:
        """Before `leader` frees its blocks: pin those its waiting siblings share, where registered."""
        if not bm.forks_samples or leader.num_dropped_blocks:
            return
        num_blocks = max((num_shared_blocks(s, bm.block_size) for s in waiting if s.prompt_leader is leader),
                         default=0)
        blocks = leader.block_table[:min(num_blocks, leader.num_hashed_blocks)]
        if blocks:
            bm.pin(blocks)
            self.held[leader.seq_id] = (leader, blocks)

    def release_unneeded(self, waiting: Iterable[Sequence], bm: BlockManager) -> None:
        """Unpin the blocks of leaders no sibling waits on any more (those admitted hold their own)."""
        if not self.held:
            return
        awaited = {s.prompt_leader.seq_id for s in waiting if s.prompt_leader is not None}
        for seq_id, (_, blocks) in list(self.held.items()):
            if seq_id not in awaited:
                bm.unpin(blocks)
                del self.held[seq_id]

    def release_all(self, bm: BlockManager) -> bool:
        """Unpin every block, where memory is short: a pin never preempts a row or stops one that
        would fit from running. True if anything was pinned."""
        for _, blocks in self.held.values():
            bm.unpin(blocks)
        released = bool(self.held)
        self.held.clear()
        return released

    def drop(self) -> None:
        """Forget every pin: the pool they were in is being replaced."""
        self.held.clear()
