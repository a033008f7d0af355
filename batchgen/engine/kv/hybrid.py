"""One paged KV pool for several layer groups (kv/groups.py): each sequence has a block table per
group, all drawing on one pool, behind the interface the scheduler uses with a BlockManager. No torch.

- A sequence's first group (a full-attention one) keeps its blocks in the Sequence's own fields;
  the others in `seq.kv_groups`. A token has a slot in every group, so a step's allocation takes
  a block in each group that needs one.
- A sliding group returns blocks once they leave its window (`drop_out_of_window`): a sequence
  holds at most `groups.window_blocks` blocks there, however long it grows.
- Prefix caching: each group chains its own hashes (salted by the group), and a hit of n blocks
  needs, in a full group, all n of them cached, in a sliding group only those its window still
  sees from the first token it computes (vLLM's rule); the ones before count as dropped. The hit
  is the longest n that every group holds.
- Static policy: a full group reserves every token at admission (as BlockManager does); a sliding
  group cannot (its blocks come and go), so it promises the sequence the most blocks it will
  hold there (`window_blocks`, for the step's `chunk_tokens`), and other sequences' admissions and
  allocations leave the promised blocks free. A static batch thus never preempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from batchgen.engine.kv.block_manager import DROPPED_BLOCK, BlockManager
from batchgen.engine.kv.groups import KVGroups, window_blocks
from batchgen.engine.sequence import GroupBlocks, Sequence


def make_block_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool, kv_window: int | None,
                       kv_groups: KVGroups | None) -> BlockManager:
    """The engine's pool: one group (dropping behind `kv_window` where every layer has it), or `kv_groups`."""
    if kv_groups is None:
        return BlockManager(num_blocks, block_size, enable_prefix_caching, sliding_window=kv_window)
    return HybridBlockManager(num_blocks, block_size, kv_groups, enable_prefix_caching)


@dataclass(slots=True)
class Promise:
    """A static sequence's claim on each sliding group: `bound` blocks held at most, of which
    `num_outstanding` (over the groups) are not taken yet and must stay free."""

    bound: int
    num_outstanding: int = 0


@dataclass(slots=True)
class PrefixHit:
    """A prefix-cache hit of `num_blocks` full blocks in every group; what the scheduler passes
    back to `can_admit` / `admit` (it reads only its length)."""

    num_blocks: int = 0
    block_ids: list[list[int]] = field(default_factory=list)  # per group; DROPPED_BLOCK before num_dropped
    block_hashes: list[list[int]] = field(default_factory=list)  # per group: the chain, dropped blocks' too
    num_dropped: list[int] = field(default_factory=list)  # per group: leading blocks its window no longer sees

    def __len__(self) -> int:
        return self.num_blocks


class HybridBlockManager(BlockManager):
    # a fork would share one group's table only: samples of a request meet through the prefix cache
    forks_samples = False

    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.groups = groups
        self.group_windows = groups.group_windows
        self.salts: list[int | None] = [None] + [hash(("kv group", k)) for k in range(1, groups.num_groups)]
        # static policy: seq_id -> Promise, and the blocks promised and not yet taken, over all of them
        self.promises: dict[int, Promise] = {}
        self.num_promised_blocks = 0

    def tables(self, seq: Sequence) -> list[Sequence | GroupBlocks]:
        """`seq`'s block fields per group, in group order."""
        return [seq, *seq.kv_groups]

    # ---- queries -------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        if not self.enable_prefix_caching:
            return PrefixHit()
        chains: list[list[tuple[int, int | None]]] = []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        for salt, window in zip(self.salts, self.group_windows, strict=True):
            chain = []
            for h, block_id in islice(self._cached_chain(seq, salt), num_blocks):
                if block_id is None and window is None:
                    break
                chain.append((h, block_id))
            chains.append(chain)
            if window is None:
                num_blocks = len(chain)
        while num_blocks and not all(self._window_held(chain, num_blocks, w)
                                     for chain, w in zip(chains, self.group_windows, strict=True) if w is not None):
            num_blocks -= 1
        if num_blocks == 0:
            return PrefixHit()
        hit = PrefixHit(num_blocks)
        for chain, window in zip(chains, self.group_windows, strict=True):
            dropped = self._first_seen_block(num_blocks, window)
            hit.block_ids.append([DROPPED_BLOCK] * dropped + [b for _, b in chain[dropped:num_blocks]])
            hit.block_hashes.append([h for h, _ in chain[:num_blocks]])
            hit.num_dropped.append(dropped)
        return hit

    def _first_seen_block(self, num_blocks: int, window: int | None) -> int:
        """The first block a window still sees once `num_blocks` blocks are computed (0: all)."""
        if window is None:
            return 0
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def _window_held(self, chain: list[tuple[int, int | None]], num_blocks: int, window: int) -> bool:
        return all(b is not None for _, b in chain[self._first_seen_block(num_blocks, window):num_blocks])

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """The first (full) group's: what a static reservation covers (scheduler's overrun check)."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _needed(self, seq: Sequence, num_tokens: int) -> int:
        blocks = -(-num_tokens // self.block_size)
        return sum(max(0, blocks - len(t.block_table)) for t in self.tables(seq))

    def _outstanding(self, seq: Sequence, bound: int) -> int:
        """Blocks of `bound` per sliding group `seq` does not hold there now."""
        return sum(max(0, bound - (len(t.block_table) - t.num_dropped_blocks))
                   for t, w in zip(self.tables(seq), self.group_windows, strict=True) if w is not None)

    def _update_promise(self, seq: Sequence) -> None:
        """Recount a promised sequence's outstanding blocks after its tables changed."""
        promise = self.promises.get(seq.seq_id)
        if promise is not None:
            outstanding = self._outstanding(seq, promise.bound)
            self.num_promised_blocks += outstanding - promise.num_outstanding
            promise.num_outstanding = outstanding

    def _promise(self, hit: PrefixHit, num_tokens: int, reserve_tokens: int, chunk_tokens: int | None) -> int:
        """Per sliding group: the most blocks a static sequence admitted this way holds there."""
        assert chunk_tokens is not None, "a static reservation needs the step's chunk size"
        reserve_blocks = -(-max(num_tokens, reserve_tokens) // self.block_size)
        return max(min(reserve_blocks, window_blocks(w, chunk_tokens, self.block_size))
                   for w in self.group_windows if w is not None)

    def can_admit(self, seq: Sequence, cached_block_ids: PrefixHit, num_new_tokens: int,
                  reserve_tokens: int = 0, watermark_blocks: int = 0, chunk_tokens: int | None = None) -> bool:
        hit = cached_block_ids
        n = hit.num_blocks
        num_tokens = n * self.block_size + num_new_tokens
        blocks = -(-num_tokens // self.block_size)
        needed = revived = promised = 0
        for k, window in enumerate(self.group_windows):
            if window is None:
                needed += -(-max(num_tokens, reserve_tokens) // self.block_size) - n
            else:
                needed += blocks - n
                if reserve_tokens:  # what it may hold there beyond what it takes now
                    held = blocks - hit.num_dropped[k] if n else blocks
                    promised += max(0, self._promise(hit, num_tokens, reserve_tokens, chunk_tokens) - held)
            if n:
                revived += sum(1 for b in hit.block_ids[k][hit.num_dropped[k]:] if self.blocks[b].ref_count == 0)
        return needed + revived + promised + watermark_blocks + self.num_promised_blocks <= self.num_free_blocks

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        promised = self.num_promised_blocks
        if promised:  # its own promise is what it grows into
            promise = self.promises.get(seq.seq_id)
            promised -= 0 if promise is None else promise.num_outstanding
        return self._needed(seq, num_tokens) <= self.num_free_blocks - promised

    # ---- mutations -----------------------------------------------------------------------
    def admit(self, seq: Sequence, cached_block_ids: PrefixHit, num_new_tokens: int,
              reserve_tokens: int = 0, chunk_tokens: int | None = None) -> None:
        hit = cached_block_ids
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not seq.kv_groups:
            seq.kv_groups = [GroupBlocks() for _ in range(self.groups.num_groups - 1)]
        n = hit.num_blocks
        num_tokens = n * self.block_size + num_new_tokens
        tables = self.tables(seq)
        for k, t in enumerate(tables):  # every group's hit first: an allocation must not evict another's
            assert not t.block_table
            if n:
                for block_id in hit.block_ids[k][hit.num_dropped[k]:]:
                    block = self.blocks[block_id]
                    if block.ref_count == 0:
                        del self.free_queue[block_id]
                    block.ref_count += 1
                t.block_table.extend(hit.block_ids[k])
                t.block_hashes.extend(hit.block_hashes[k])
                t.num_dropped_blocks = hit.num_dropped[k]
                t.num_hashed_blocks = n
        for t, window in zip(tables, self.group_windows, strict=True):
            tokens = max(num_tokens, reserve_tokens) if window is None else num_tokens
            self._allocate(t, max(0, -(-tokens // self.block_size) - len(t.block_table)))
        seq.num_computed_tokens = n * self.block_size
        self.num_prefix_hit_tokens += n * self.block_size
        if reserve_tokens:
            self.promises[seq.seq_id] = Promise(self._promise(hit, num_tokens, reserve_tokens, chunk_tokens))
            self._update_promise(seq)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        blocks = -(-num_tokens // self.block_size)
        for t in self.tables(seq):
            self._allocate(t, max(0, blocks - len(t.block_table)))
        self._update_promise(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        if self.enable_prefix_caching:
            for t, salt in zip(self.tables(seq), self.salts, strict=True):
                self._cache_full_blocks(seq, t, salt)

    def drop_out_of_window(self, seq: Sequence) -> int:
        dropped = sum(self._drop_out_of_window(seq, t, w)
                      for t, w in zip(self.tables(seq), self.group_windows, strict=True) if w is not None)
        if dropped:
            self._update_promise(seq)
        return dropped

    def free(self, seq: Sequence) -> None:
        for t in reversed(self.tables(seq)):
            self._free(t)
        promise = self.promises.pop(seq.seq_id, None)
        if promise is not None:
            self.num_promised_blocks -= promise.num_outstanding

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, live_seqs: list[Sequence] | None = None) -> None:
        owners: dict[int, int] = {}
        for seq in live_seqs or []:
            assert len(seq.kv_groups) in (0, self.groups.num_groups - 1)
            for t, w in zip(self.tables(seq), self.group_windows, strict=False):
                self._check_table(seq, t, w, owners)
                # a full group may hold a static reservation ahead; a sliding group takes blocks as it goes
                assert len(t.block_table) <= len(seq.block_table), "a group ahead of the first"
        if live_seqs is not None:
            live = {s.seq_id for s in live_seqs}
            assert set(self.promises) <= live, "a promise outlived its sequence"
            by_id = {s.seq_id: s for s in live_seqs}
            for seq_id, promise in self.promises.items():
                assert promise.num_outstanding == self._outstanding(by_id[seq_id], promise.bound)
        self._check_pool(owners if live_seqs is not None else None)
        assert self.num_promised_blocks == sum(p.num_outstanding for p in self.promises.values())
        assert self.num_promised_blocks <= self.num_free_blocks, "promised blocks are not free"
