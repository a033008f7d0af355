"""Samples of one request (sampling.n > 1): their prompt is computed once, its K/V blocks shared. No torch.

The engine makes one sequence per sample; the first is the leader, the others point at it
(`Sequence.prompt_leader`). A sibling is admitted with the leader's blocks of the prompt's full
blocks as its prefix (the block manager's ref counts share them; the same admission a prefix-cache
hit takes), and computes only the prompt's last, partial block and its own tokens: never fewer than
one token, which gives it the logits of its first draw. The rule each admission follows:

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

Forking copies no K/V and needs no copy-on-write: the shared blocks are full prompt blocks, which no
sample ever writes again; each sample's partial last block is its own. Preemption, chunked prefill,
continuations (a continued sample shares the prompt's blocks and recomputes its own tokens) and both
policies keep working because a sibling is an ordinary sequence once admitted.
"""

from __future__ import annotations

from batchgen.engine.kv.block_manager import BlockManager
from batchgen.engine.scheduler.sequence import Sequence, SequenceStatus


def num_shared_blocks(seq: Sequence, block_size: int) -> int:
    """The prompt's full blocks a sample may take from its leader (its last token is always computed)."""
    return min(seq.num_prompt_tokens, seq.num_tokens - 1) // block_size


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
    return leader.block_table[:num_blocks], leader.num_computed_tokens < num_blocks * bm.block_size


def awaiting(seq: Sequence) -> bool:
    """Admitted with its leader's blocks, which the leader has not computed yet: skip it this step.
    Clears the mark once the leader has."""
    if not seq.awaits_leader_tokens:
        return False
    assert seq.prompt_leader is not None and seq.prompt_leader.status is SequenceStatus.RUNNING
    if seq.prompt_leader.num_computed_tokens < seq.awaits_leader_tokens:
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
