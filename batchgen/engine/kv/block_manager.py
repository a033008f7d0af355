"""Paged KV memory: a pool of fixed-size blocks, ref counts, and a prefix cache. No torch.

Free blocks live in one insertion-ordered dict used as an O(1) LRU queue:

    front: blocks with no cached content (reused first: nothing is lost by reusing them)
    back:  freed blocks that still hold a cached prefix, least recently freed first

Allocation pops the front; a block popped while still hashed drops its hash (its content is
evicted). A prefix-cache hit on a free block removes it from the queue in O(1) and revives it.
Sequences free their blocks in reverse, so a chain's tail is evicted before its head.

Prefix hashes are chained over full blocks: hash_i = hash((hash_{i-1}, tokens of block i)).
Each cached block also keeps its tokens, so a hit is confirmed by equality, not by the hash alone.

With a sliding window on every layer (`sliding_window`), a sequence's blocks whose tokens no later
query can see any more go back to the pool after each step (`drop_out_of_window`), as freed
blocks do: hashed ones stay in the prefix cache until evicted. Their block-table entries become
DROPPED_BLOCK (block 0): the attention reads there at most keys its window masks (the C decode
kernel not even those), and block 0 always holds finite values (the cache starts zeroed), so a
masked key adds exactly 0. A prefix hit still needs the whole chain from the first block, so a
hit is never longer than what the cache holds.

A model with full-attention and sliding layers mixed has a block table per layer group, all drawing
on one pool: kv/hybrid.py, which reuses this class's pool and its per-table helpers (`_allocate`,
`_cache_full_blocks`, `_drop_out_of_window`, `_free`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from batchgen.engine.sequence import GroupBlocks, Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # set with block_hash, for the equality check


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is deterministic (no per-process salt), and equality of
    # token_ids is checked on every hit, so a 64-bit collision can never return wrong K/V.
    return hash((parent_hash, token_ids))


def chain_root(seq: Sequence, salt: int | None) -> int | None:
    """Where a sequence's chain of block hashes starts: a LoRA adapter's K/V differ from the base
    model's for the same tokens, so each adapter's blocks chain from their own root: a block's hash
    covers its adapter as it covers the tokens before it."""
    adapter = seq.request.adapter
    return salt if adapter is None else hash((salt, "lora adapter", adapter))


DROPPED_BLOCK = 0  # the block-table entry of a block dropped out of the window: a real block, read only masked


class BlockManager:
    # samples of one request may share their leader's prompt blocks (engine/scheduler/samples.py)
    forks_samples = True

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # tokens every layer's queries see back from themselves (themselves included); None: all
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_hit_tokens = 0  # counter for metrics
        # block id -> references held for rows that will start from it (scheduler/samples.py, LeaderPins)
        self.pinned: dict[int, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s full blocks. No side effects.

        The last token is never taken from the cache: the model must compute it to produce
        the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        for _, block_id in self._cached_chain(seq, None):
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def _cached_chain(self, seq: Sequence, salt: int | None) -> Iterator[tuple[int, int | None]]:
        """(chain hash, the cached block holding it or None) of each full block of `seq` that may
        come from the cache; `salt` starts a layer group's own chain (kv/hybrid.py)."""
        parent = chain_root(seq, salt)
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block_id.get(h)
            yield h, (block_id if block_id is not None and self.blocks[block_id].token_ids == tokens else None)
            parent = h

    def can_admit(self, seq: Sequence, cached_block_ids: list[int], num_new_tokens: int,
                  reserve_tokens: int = 0, watermark_blocks: int = 0, chunk_tokens: int | None = None) -> bool:
        """Could `seq` start with this prefix hit and `num_new_tokens` (or `reserve_tokens`)?
        `chunk_tokens` (the most one step computes of a sequence) bounds a reservation in a
        window's layer group (kv/hybrid.py); this one pool reserves every token."""
        num_cached_tokens = len(cached_block_ids) * self.block_size
        num_tokens = max(num_cached_tokens + num_new_tokens, reserve_tokens)
        needed = -(-num_tokens // self.block_size) - len(cached_block_ids)
        # cached blocks that sit in the free queue are taken out of it by the hit
        revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return needed + revived + watermark_blocks <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------
    def admit(self, seq: Sequence, cached_block_ids: list[int], num_new_tokens: int,
              reserve_tokens: int = 0, chunk_tokens: int | None = None) -> None:
        """Give a waiting sequence its cached prefix (or the prompt blocks of the sample it shares
        them with) plus blocks for `num_new_tokens` more."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        parent = chain_root(seq, None)
        for i, block_id in enumerate(cached_block_ids):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            # a sibling sample's fork (scheduler/samples.py) may take blocks not registered yet: their
            # chained hash comes from the tokens, so its own later blocks chain on the right parent
            if block.block_hash is None and self.enable_prefix_caching:
                parent = chain_hash(parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            else:
                parent = block.block_hash
            seq.block_hashes.append(parent)
        num_cached_tokens = len(cached_block_ids) * self.block_size
        seq.num_hashed_blocks = len(cached_block_ids)
        seq.num_computed_tokens = num_cached_tokens
        self.num_prefix_hit_tokens += num_cached_tokens
        self.allocate(seq, max(num_cached_tokens + num_new_tokens, reserve_tokens))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks so `seq` has slots for its first `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed:  # most decode steps need none
            self._allocate(seq, needed)

    def _allocate(self, blocks: Sequence | GroupBlocks, needed: int) -> None:
        """Append `needed` fresh blocks to one group's block table of a sequence."""
        assert needed <= self.num_free_blocks, "caller must check can_allocate first"
        for _ in range(needed):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0
            if block.block_hash is not None:  # evict its cached content
                if self.hash_to_block_id.get(block.block_hash) == block_id:
                    del self.hash_to_block_id[block.block_hash]
                block.block_hash = None
                block.token_ids = None
            block.ref_count = 1
            blocks.block_table.append(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full and computed, so later sequences hit them."""
        if self.enable_prefix_caching and seq.num_computed_tokens // self.block_size > seq.num_hashed_blocks:
            self._cache_full_blocks(seq, seq, None)

    def _cache_full_blocks(self, seq: Sequence, blocks: Sequence | GroupBlocks, salt: int | None) -> None:
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(blocks.num_hashed_blocks, num_full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = blocks.block_hashes[i - 1] if i > 0 else chain_root(seq, salt)
            h = chain_hash(parent, tokens)
            block = self.blocks[blocks.block_table[i]]
            assert block.block_hash is None
            block.block_hash = h
            block.token_ids = tokens
            # first writer wins; a duplicate (computed twice concurrently) just stays private
            self.hash_to_block_id.setdefault(h, block.block_id)
            blocks.block_hashes.append(h)
        blocks.num_hashed_blocks = max(blocks.num_hashed_blocks, num_full)

    def drop_out_of_window(self, seq: Sequence) -> int:
        """Return the blocks of `seq` that no query from its next token on can see (all of their
        tokens before `num_computed_tokens - sliding_window + 1`); how many it dropped. Call after
        `cache_full_blocks`, so a dropped block keeps its place in the prefix cache."""
        if self.sliding_window is None:
            return 0
        return self._drop_out_of_window(seq, seq, self.sliding_window)

    def _drop_out_of_window(self, seq: Sequence, blocks: Sequence | GroupBlocks, sliding_window: int) -> int:
        first_seen = seq.num_computed_tokens - sliding_window + 1  # the next query's first key
        end = min(max(0, first_seen) // self.block_size, len(blocks.block_table))
        for i in range(blocks.num_dropped_blocks, end):
            self._release(blocks.block_table[i])
            blocks.block_table[i] = DROPPED_BLOCK
        dropped = max(0, end - blocks.num_dropped_blocks)
        blocks.num_dropped_blocks = max(blocks.num_dropped_blocks, end)
        return dropped

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count >= 1
        block.ref_count -= 1
        if block.ref_count == 0:
            cached = (block.block_hash is not None
                      and self.hash_to_block_id.get(block.block_hash) == block_id)
            if not cached and block.block_hash is not None:
                block.block_hash = None  # a private duplicate: nothing to keep
                block.token_ids = None
            self.free_queue[block_id] = None
            if not cached:
                self.free_queue.move_to_end(block_id, last=False)

    def pin(self, block_ids: list[int]) -> None:
        """Hold blocks (and their place in the prefix cache) with no sequence holding them."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            self.pinned[block_id] = self.pinned.get(block_id, 0) + 1

    def unpin(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # tail first, as a sequence frees them
            self.pinned[block_id] -= 1
            if not self.pinned[block_id]:
                del self.pinned[block_id]
            self._release(block_id)

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` it still holds (tail first) and reset its cache bookkeeping."""
        self._free(seq)

    def _free(self, blocks: Sequence | GroupBlocks) -> None:
        for block_id in reversed(blocks.block_table[blocks.num_dropped_blocks:]):
            self._release(block_id)
        blocks.block_table.clear()
        blocks.num_dropped_blocks = 0
        blocks.block_hashes.clear()
        blocks.num_hashed_blocks = 0

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, live_seqs: list[Sequence] | None = None) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        owners: dict[int, int] = dict(self.pinned)
        for seq in live_seqs or []:
            self._check_table(seq, seq, self.sliding_window, owners)
        self._check_pool(owners if live_seqs is not None else None)

    def _check_table(self, seq: Sequence, blocks: Sequence | GroupBlocks, sliding_window: int | None,
                     owners: dict[int, int]) -> None:
        held = blocks.block_table[blocks.num_dropped_blocks:]
        assert all(b == DROPPED_BLOCK for b in blocks.block_table[:blocks.num_dropped_blocks])
        assert len(set(held)) == len(held), f"seq {seq.seq_id} repeats a block"
        if sliding_window is None:
            assert blocks.num_dropped_blocks == 0
        else:  # never a block some later query still sees
            assert blocks.num_dropped_blocks * self.block_size <= max(
                0, seq.num_computed_tokens - sliding_window + 1)
        for block_id in held:
            owners[block_id] = owners.get(block_id, 0) + 1

    def _check_pool(self, owners: dict[int, int] | None) -> None:
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            assert (block.ref_count == 0) == in_free, f"block {block.block_id}: ref/free mismatch"
            if owners is not None:
                assert owners.get(block.block_id, 0) == block.ref_count, (
                    f"block {block.block_id}: ref_count {block.ref_count} != "
                    f"{owners.get(block.block_id, 0)} owners")
            assert (block.block_hash is None) == (block.token_ids is None)
        for h, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].block_hash == h, f"stale hash entry for block {block_id}"
        assert len(self.free_queue) + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks
