"""HybridBlockManager on plain ints: one pool, a block table per layer group, sliding groups
returning blocks behind their window, prefix hits that need only what each window sees, and static
promises."""

from __future__ import annotations

from batchgen.engine.kv.block_manager import DROPPED_BLOCK
from batchgen.engine.kv.groups import plan_groups, window_blocks
from batchgen.engine.kv.hybrid import HybridBlockManager
from batchgen.engine.request import Request
from batchgen.engine.sequence import Sequence, SequenceStatus

BS = 4
WINDOW = 6
GROUPS = plan_groups([WINDOW, None])  # a full group and a sliding one, one layer each


def make_seq(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence.from_request(seq_id, Request(str(seq_id), list(token_ids)))


def run(bm: HybridBlockManager, seq: Sequence, chunk: int, live: list[Sequence]) -> None:
    """Admit `seq` with the cache's hit, then compute it `chunk` tokens a step as the scheduler does."""
    hit = bm.find_cached_prefix(seq)
    num_new = min(chunk, seq.num_tokens - len(hit) * BS)
    assert bm.can_admit(seq, hit, num_new)
    bm.admit(seq, hit, num_new)
    seq.status = SequenceStatus.RUNNING
    live.append(seq)
    while True:
        seq.num_computed_tokens += num_new
        bm.cache_full_blocks(seq)
        bm.drop_out_of_window(seq)
        bm.check_integrity(live)
        if seq.num_computed_tokens == seq.num_tokens:
            return
        num_new = min(chunk, seq.num_uncomputed_tokens)
        assert bm.can_allocate(seq, seq.num_computed_tokens + num_new)
        bm.allocate(seq, seq.num_computed_tokens + num_new)


def test_a_sliding_group_returns_what_leaves_its_window_and_the_full_group_keeps_all():
    bm = HybridBlockManager(64, BS, GROUPS)
    seq = make_seq(0, list(range(10, 50)))
    run(bm, seq, 8, [])
    sliding = seq.kv_groups[0]
    assert len(seq.block_table) == len(sliding.block_table) == 10
    assert DROPPED_BLOCK not in seq.block_table[1:] and seq.num_dropped_blocks == 0
    assert sliding.num_dropped_blocks == (40 - WINDOW + 1) // BS  # blocks before the next query's first key
    held = len(sliding.block_table) - sliding.num_dropped_blocks
    assert held <= window_blocks(WINDOW, 8, BS)
    assert bm.num_used_blocks == 10 + held
    bm.free(seq)
    assert bm.num_free_blocks == 64 and not seq.kv_groups[0].block_table
    bm.check_integrity([])


def test_a_prefix_hit_needs_in_a_sliding_group_only_the_blocks_its_window_sees():
    bm = HybridBlockManager(40, BS, GROUPS)
    prompt = list(range(10, 42))  # 8 full blocks
    first = make_seq(0, prompt + [1])
    run(bm, first, 8, [])
    bm.free(first)
    # the least recently freed cached blocks are the sliding group's first ones (dropped while it
    # ran): a stranger taking the 24 uncached free blocks and 4 more evicts sliding blocks 0-3
    stranger = make_seq(1, list(range(100, 153)))  # 14 blocks in each group
    assert not bm.find_cached_prefix(stranger)
    bm.admit(stranger, bm.find_cached_prefix(stranger), 53)
    bm.free(stranger)  # uncached blocks: back to the front of the queue, the evicted ones gone
    second = make_seq(2, prompt + [2, 3])
    hit = bm.find_cached_prefix(second)
    dropped = (8 * BS - WINDOW + 1) // BS
    assert len(hit) == 8 and hit.num_dropped == [0, dropped]
    assert hit.block_ids[1][:dropped] == [DROPPED_BLOCK] * dropped
    # a block the window still needs leaves the cache: the hit shortens to what the window holds
    needed = hit.block_ids[1][-1]
    del bm.hash_to_block_id[bm.blocks[needed].block_hash]
    bm.blocks[needed].block_hash = bm.blocks[needed].token_ids = None
    shorter = bm.find_cached_prefix(second)
    assert len(shorter) == 7 and needed not in shorter.block_ids[1]
    live: list[Sequence] = []
    run(bm, second, 8, live)
    assert second.num_computed_tokens == second.num_tokens
    assert bm.num_prefix_hit_tokens == 7 * BS


def test_admission_takes_every_groups_hit_before_allocating_any():
    """The full group's new blocks come from the free queue's front; a sliding group's hit blocks
    sitting there must not be handed out first (they would then hold other tokens' K/V)."""
    bm = HybridBlockManager(24, BS, GROUPS)
    prompt = list(range(10, 30))  # 5 blocks
    first = make_seq(0, prompt + [1])
    run(bm, first, 32, [])
    bm.free(first)
    second = make_seq(1, prompt + list(range(300, 310)))
    hit = bm.find_cached_prefix(second)
    assert len(hit) == 5
    for block_id in reversed(hit.block_ids[1][hit.num_dropped[1]:]):
        bm.free_queue.move_to_end(block_id, last=False)  # first in line for reuse
    num_new = second.num_tokens - 5 * BS
    assert bm.can_admit(second, hit, num_new)
    bm.admit(second, hit, num_new)
    for t in bm.tables(second):
        for i in range(t.num_dropped_blocks, 5):
            assert bm.blocks[t.block_table[i]].token_ids == tuple(prompt[i * BS:(i + 1) * BS])
    bm.check_integrity([second])


def test_static_promises_keep_a_sliding_groups_blocks_for_its_sequence():
    bm = HybridBlockManager(40, BS, GROUPS, enable_prefix_caching=False)
    chunk = 8
    bound = window_blocks(WINDOW, chunk, BS)
    a = make_seq(0, list(range(10, 18)))
    hit = bm.find_cached_prefix(a)
    assert bm.can_admit(a, hit, 0, reserve_tokens=80, chunk_tokens=chunk)
    bm.admit(a, hit, 0, reserve_tokens=80, chunk_tokens=chunk)
    assert len(a.block_table) == 20  # the full group reserves every token
    assert len(a.kv_groups[0].block_table) == 0  # the sliding group takes blocks as it goes...
    assert bm.num_promised_blocks == bound  # ...but they are promised
    # others see 40 - 20 - bound free blocks, and their own sliding bound counts too
    b = make_seq(1, list(range(10, 18)))
    fits = (40 - 20 - 2 * bound) * BS
    assert bm.can_admit(b, hit, 0, reserve_tokens=fits, chunk_tokens=chunk)
    assert not bm.can_admit(b, hit, 0, reserve_tokens=fits + BS, chunk_tokens=chunk)
    a.status = SequenceStatus.RUNNING
    a.num_computed_tokens = 0
    for target in range(chunk, 81, chunk):  # a's own allocations never wait on its own promise
        assert bm.can_allocate(a, target)
        bm.allocate(a, target)
        a.num_computed_tokens = target
        bm.drop_out_of_window(a)
        bm.check_integrity([a])
        assert bm.num_promised_blocks + bm.num_used_blocks <= 40
    bm.free(a)
    assert not bm.promises and bm.num_free_blocks == 40
