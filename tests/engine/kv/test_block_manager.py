"""BlockManager on plain ints: accounting, LRU reuse order, chained prefix hits, integrity checks."""

from __future__ import annotations

import pytest

from batchgen.engine.kv import block_manager as bm_module
from batchgen.engine.kv.block_manager import BlockManager
from batchgen.engine.request import Request
from batchgen.engine.sequence import Sequence, SequenceStatus

BS = 4  # block size used throughout


def make_seq(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence.from_request(seq_id, Request(str(seq_id), list(token_ids)))


def admit_and_compute(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` with whatever prefix the cache has, compute all its tokens, register its blocks."""
    hit = bm.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(hit) * bm.block_size
    assert bm.can_admit(seq, hit, num_new)
    bm.admit(seq, hit, num_new)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return hit


def hit_blocks(bm: BlockManager, token_ids: list[int]) -> list[int]:
    return bm.find_cached_prefix(make_seq(999, token_ids))


def test_allocate_and_free_accounting():
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(0, list(range(10)))
    bm.admit(seq, [], 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7 and bm.num_used_blocks == 3
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.check_integrity([seq])

    assert bm.blocks_needed(seq, 12) == 0  # still inside the third block
    assert bm.blocks_needed(seq, 13) == 1
    bm.allocate(seq, 13)
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 6
    assert bm.can_allocate(seq, 40) and not bm.can_allocate(seq, 41)
    with pytest.raises(AssertionError):
        bm.allocate(seq, 41)
    bm.check_integrity([seq])

    other = make_seq(1, list(range(100, 105)))
    bm.admit(other, [], 5)
    assert not set(other.block_table) & set(seq.block_table)
    bm.check_integrity([seq, other])

    bm.free(seq)
    assert seq.block_table == [] and seq.block_hashes == [] and seq.num_hashed_blocks == 0
    assert bm.num_free_blocks == 8
    bm.check_integrity([other])
    bm.free(other)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_integrity([])


def test_admit_reserves_tokens_up_front():
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(0, [1, 2, 3])
    assert bm.can_admit(seq, [], 0, reserve_tokens=40)
    assert not bm.can_admit(seq, [], 0, reserve_tokens=41)
    assert not bm.can_admit(seq, [], 3, reserve_tokens=36, watermark_blocks=2)
    bm.admit(seq, [], 0, reserve_tokens=17)
    assert len(seq.block_table) == 5
    bm.check_integrity([seq])


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq(0, list(range(9)))  # 2 full blocks (cached) + 1 partial block (not cached)
    admit_and_compute(bm, a)
    a_full, a_partial = a.block_table[:2], a.block_table[2]
    bm.free(a)
    assert hit_blocks(bm, list(range(9))) == a_full

    # 4 blocks: the partial block and the 3 never-used ones; the cached prefix survives
    c = make_seq(1, [50] * 16)
    bm.admit(c, [], 16)
    assert a_partial in c.block_table and not set(a_full) & set(c.block_table)
    assert hit_blocks(bm, list(range(9))) == a_full
    bm.check_integrity([c])


def test_chain_tail_is_evicted_before_its_head():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(0, list(range(13)))  # 3 full cached blocks + 1 partial
    admit_and_compute(bm, a)
    head, middle, tail = a.block_table[:3]
    bm.free(a)

    c = make_seq(1, [77])
    bm.admit(c, [], 1)  # takes the uncached partial block
    assert hit_blocks(bm, list(range(13))) == [head, middle, tail]
    bm.allocate(c, 5)  # one more block: evicts the tail of the chain
    assert tail in c.block_table
    assert hit_blocks(bm, list(range(13))) == [head, middle]
    bm.allocate(c, 9)
    assert middle in c.block_table and hit_blocks(bm, list(range(13))) == [head]
    bm.allocate(c, 13)
    assert head in c.block_table and hit_blocks(bm, list(range(13))) == []
    bm.check_integrity([c])


def test_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a_tokens, b_tokens = [1] * 8 + [0], [2] * 8 + [0]
    a, b = make_seq(0, a_tokens[:8]), make_seq(1, b_tokens[:8])
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    a_blocks = list(a.block_table)
    bm.free(a)  # a's blocks freed first: they are the older cache entries
    bm.free(b)
    assert len(hit_blocks(bm, a_tokens)) == 2 and len(hit_blocks(bm, b_tokens)) == 2

    c = make_seq(2, [9] * 8)
    bm.admit(c, [], 8)  # needs exactly two blocks: a's go, b's stay
    assert sorted(c.block_table) == sorted(a_blocks)
    assert hit_blocks(bm, a_tokens) == [] and len(hit_blocks(bm, b_tokens)) == 2
    bm.check_integrity([c])


def test_reused_blocks_follow_free_order_across_chains():
    # a block freed later (b) outlives one freed earlier (a) even when a was allocated later
    bm = BlockManager(num_blocks=2, block_size=BS)
    b = make_seq(1, [2] * 4)
    a = make_seq(0, [1] * 4)
    admit_and_compute(bm, b)
    admit_and_compute(bm, a)
    bm.free(a)
    bm.free(b)
    c = make_seq(2, [9])
    bm.admit(c, [], 1)
    assert hit_blocks(bm, [1] * 4 + [0]) == [] and len(hit_blocks(bm, [2] * 4 + [0])) == 1


def test_prefix_hits_follow_the_chain_of_full_blocks():
    bm = BlockManager(num_blocks=20, block_size=BS)
    prefix = [10, 11, 12, 13, 20, 21, 22, 23]
    a = make_seq(0, prefix + [30, 31, 32])
    admit_and_compute(bm, a)
    first, second = a.block_table[:2]

    assert hit_blocks(bm, prefix + [40, 41]) == [first, second]  # shared prefix hits
    assert hit_blocks(bm, prefix[:4] + [99, 21, 22, 23, 5]) == [first]  # differing block breaks it
    # the second block alone matches a's second block, but its chain (parent hash) differs
    assert hit_blocks(bm, [0, 11, 12, 13] + prefix[4:] + [5]) == []
    assert hit_blocks(bm, prefix[:3] + [5]) == []  # no full block

    # the last token is never served from the cache: exactly 2 full blocks hit at most 1
    assert hit_blocks(bm, prefix) == [first]
    assert hit_blocks(bm, prefix + [0]) == [first, second]

    b = make_seq(1, prefix + [40, 41])
    assert admit_and_compute(bm, b) == [first, second]
    assert b.block_table[:2] == [first, second]
    assert b.num_hashed_blocks >= 2 and b.block_hashes[:2] == a.block_hashes[:2]
    assert bm.blocks[first].ref_count == 2 and bm.blocks[second].ref_count == 2
    assert bm.num_prefix_hit_tokens == 8
    bm.check_integrity([a, b])

    bm.free(a)
    assert bm.blocks[first].ref_count == 1 and first not in bm.free_queue
    bm.check_integrity([b])
    bm.free(b)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks


def test_admission_with_a_hit_sets_computed_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit_and_compute(bm, make_seq(0, list(range(9))))
    seq = make_seq(1, list(range(8)) + [50, 51, 52])
    hit = bm.find_cached_prefix(seq)
    assert len(hit) == 2
    bm.admit(seq, hit, 3)
    assert seq.num_computed_tokens == 8 and seq.num_hashed_blocks == 2
    assert len(seq.block_table) == 3


def test_hit_on_a_freed_cached_block_revives_it():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(0, list(range(9)))
    admit_and_compute(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and all(b in bm.free_queue for b in cached)

    # 13 tokens = 4 blocks: 2 revived from the cache + 2 new ones, exactly the 4 free blocks
    b = make_seq(1, list(range(8)) + [50] * 5)
    hit = bm.find_cached_prefix(b)
    assert hit == cached
    assert bm.can_admit(b, hit, 5)
    assert not bm.can_admit(b, hit, 9)  # 5 blocks do not fit, revived ones count as used
    bm.admit(b, hit, 5)
    assert all(bm.blocks[x].ref_count == 1 and x not in bm.free_queue for x in cached)
    assert bm.num_free_blocks == 0
    # the revived blocks keep their hashes: they still serve later hits
    assert hit_blocks(bm, list(range(8)) + [7]) == cached
    bm.check_integrity([b])


def test_eviction_drops_the_hash():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = make_seq(0, list(range(5)))
    admit_and_compute(bm, a)
    block_id = a.block_table[0]
    block_hash = bm.blocks[block_id].block_hash
    assert bm.hash_to_block_id == {block_hash: block_id}
    bm.free(a)
    assert bm.hash_to_block_id == {block_hash: block_id}  # freed, still cached

    c = make_seq(1, [7] * 8)
    bm.admit(c, [], 8)  # needs both blocks: the cached one is evicted
    assert bm.hash_to_block_id == {}
    assert bm.blocks[block_id].block_hash is None and bm.blocks[block_id].token_ids is None
    assert hit_blocks(bm, list(range(5))) == []
    bm.check_integrity([c])


def test_hash_collisions_never_give_a_false_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 0)
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit_and_compute(bm, a)
    first, second = a.block_table[:2]
    assert bm.hash_to_block_id == {0: first}  # the second block collides: stays private

    assert hit_blocks(bm, [9, 9, 9, 9, 9]) == []  # same hash, other tokens
    # the first block matches for real; the second block's hash points at the first block,
    # whose tokens differ, so the chain stops there
    assert hit_blocks(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == [first]
    bm.check_integrity([a])
    bm.free(a)
    bm.check_integrity([])
    assert bm.blocks[second].block_hash is None  # the private duplicate is not kept
    assert bm.hash_to_block_id == {0: first}


def test_duplicate_content_computed_twice_stays_private_and_is_dropped_on_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(0, list(range(5))), make_seq(1, list(range(5)))
    for seq in (a, b):  # both admitted before either is computed: no hit
        bm.admit(seq, [], 5)
        seq.status = SequenceStatus.RUNNING
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.cache_full_blocks(seq)
    assert list(bm.hash_to_block_id.values()) == [a.block_table[0]]  # first writer wins
    dup = b.block_table[0]
    bm.free(b)
    assert bm.blocks[dup].block_hash is None
    bm.check_integrity([a])
    assert hit_blocks(bm, list(range(5))) == [a.block_table[0]]


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(0, list(range(9)))
    admit_and_compute(bm, a)
    assert bm.hash_to_block_id == {} and a.num_hashed_blocks == 0
    assert hit_blocks(bm, list(range(9))) == []


def _two_live_seqs() -> tuple[BlockManager, list[Sequence]]:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(0, list(range(9)))
    admit_and_compute(bm, a)
    b = make_seq(1, list(range(9)))
    admit_and_compute(bm, b)
    bm.check_integrity([a, b])
    return bm, [a, b]


def test_check_integrity_catches_a_bumped_ref_count():
    bm, seqs = _two_live_seqs()
    bm.blocks[seqs[0].block_table[-1]].ref_count += 1
    with pytest.raises(AssertionError):
        bm.check_integrity(seqs)


def test_check_integrity_catches_a_used_block_in_the_free_queue():
    bm, seqs = _two_live_seqs()
    bm.free_queue[seqs[1].block_table[-1]] = None
    with pytest.raises(AssertionError):
        bm.check_integrity(seqs)


def test_check_integrity_catches_a_stale_hash_entry():
    bm, seqs = _two_live_seqs()
    block = bm.blocks[seqs[0].block_table[0]]
    block.block_hash, block.token_ids = None, None
    with pytest.raises(AssertionError):
        bm.check_integrity(seqs)


def test_check_integrity_catches_a_block_owned_twice():
    bm, seqs = _two_live_seqs()
    seqs[1].block_table.append(seqs[1].block_table[-1])
    with pytest.raises(AssertionError):
        bm.check_integrity(seqs)


# ---- a sliding window on every layer: blocks no later query sees go back to the pool ------------

def test_blocks_out_of_every_window_return_to_the_pool():
    bm = BlockManager(num_blocks=12, block_size=BS, sliding_window=6)
    seq = make_seq(0, list(range(20)))
    bm.admit(seq, [], 20)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 20
    bm.cache_full_blocks(seq)
    # the next query (position 20) sees keys 15..20: blocks 0-2 (tokens 0-11) are out of its window
    assert bm.drop_out_of_window(seq) == 3
    assert seq.block_table[:3] == [bm_module.DROPPED_BLOCK] * 3 and seq.num_dropped_blocks == 3
    assert bm.num_free_blocks == 12 - 2
    assert bm.drop_out_of_window(seq) == 0  # idempotent
    bm.check_integrity([seq])
    # the dropped blocks stay in the prefix cache: a sequence with the same prefix hits them all
    assert len(hit_blocks(bm, list(range(20)) + [99])) == 5
    bm.free(seq)
    assert bm.num_free_blocks == 12 and seq.num_dropped_blocks == 0 and not seq.block_table
    bm.check_integrity([])


def test_a_prefix_hit_on_dropped_blocks_holds_them_until_its_own_step_drops_them():
    bm = BlockManager(num_blocks=16, block_size=BS, sliding_window=5)
    first = make_seq(0, list(range(16)))
    admit_and_compute(bm, first)
    bm.drop_out_of_window(first)
    second = make_seq(1, list(range(16)) + [7, 8])
    hit = admit_and_compute(bm, second)
    assert len(hit) == 4  # the chain from block 0, revived out of the free queue
    bm.check_integrity([first, second])
    bm.drop_out_of_window(second)  # position 18's window starts at 14: blocks 0-2 go
    assert second.num_dropped_blocks == 3
    bm.check_integrity([first, second])
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 16
    bm.check_integrity([])


def test_without_a_window_nothing_is_dropped():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(0, list(range(20)))
    admit_and_compute(bm, seq)
    assert bm.drop_out_of_window(seq) == 0 and seq.num_dropped_blocks == 0
