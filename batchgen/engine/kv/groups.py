"""How a local/global model's layers share one paged KV pool (Gemma 2 and 3, gpt-oss, Cohere2, Qwen
with some sliding layers). No torch.

A sliding-window layer needs only its window's keys; a full-attention layer needs them all. So the
layers form groups, each with its own block table per sequence (kv/hybrid.py): a sliding group's
blocks go back to the pool once they leave its window, a full group's stay. As in vLLM's hybrid KV
cache manager, every group has the same number of layers, and all groups draw their blocks from one
pool: the cache has one K and one V tensor per layer *position* in a group, and a block id names the
same pages in each of them, used by whichever group holds the block. The pool thus follows the
workload (short rows hold blocks in every group, long rows mostly in the full groups) where a fixed
split of the bytes between the groups would favour one kind of row.

Grouping: layers of one kind (full, sliding) in model order, `group_size` at a time, where
`group_size` is the smaller of the two counts, so the kind with fewer layers fills its groups
exactly (the other's last group may be partial; its pages in the unused tensors stay unused). A
sliding group keeps the largest window among its layers: no layer looks further back than its own
window, and the attention masks each layer's own.
"""

from __future__ import annotations

from dataclasses import dataclass

# more groups than this only where one kind of layer is rare (1 sliding layer in 28): every step
# builds each group's block tables, for a saving of at most that kind's share of the cache
MAX_KV_GROUPS = 8


@dataclass(frozen=True, slots=True)
class KVGroups:
    group_windows: tuple[int | None, ...]  # per group: None (full attention, listed first) or the window it keeps
    layer_group: tuple[int, ...]  # per model layer: its group
    layer_tensor: tuple[int, ...]  # per model layer: which of the cache's K/V tensor pairs holds its pages
    num_tensors: int  # K/V tensor pairs in the cache: the layers of one group

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def blocks_held(self, num_tokens: int, chunk_tokens: int, block_size: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, over all groups, computing at
        most `chunk_tokens` per step."""
        blocks = -(-num_tokens // block_size)
        return sum(blocks if w is None else min(blocks, window_blocks(w, chunk_tokens, block_size))
                   for w in self.group_windows)

    def max_tokens(self, num_blocks: int, chunk_tokens: int, block_size: int) -> int:
        """The longest sequence whose blocks fit `num_blocks` (whole blocks)."""
        # blocks_held grows with the length: search the largest block count b that fits
        lo, hi = 0, num_blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_held(mid * block_size, chunk_tokens, block_size) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * block_size


def window_blocks(window: int, chunk_tokens: int, block_size: int) -> int:
    """The most blocks a sequence holds in a group that drops what leaves `window`, when a step
    computes at most `chunk_tokens` of it: the blocks covering the window before the step's first
    query plus the chunk, across block boundaries (`drop_out_of_window` runs after each step)."""
    return (window + chunk_tokens - 1) // block_size + 2


def plan_groups(windows: list[int | None]) -> KVGroups | None:
    """The layer groups of a model whose layers have these windows (None: full attention); None
    where one group does (no window, or one window on every layer: kv/block_manager.py's own), or
    where they would be more than MAX_KV_GROUPS (then all KV is kept)."""
    full = [i for i, w in enumerate(windows) if w is None]
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not full or not sliding:
        return None
    size = min(len(full), len(sliding))
    if -(-len(full) // size) + -(-len(sliding) // size) > MAX_KV_GROUPS:
        return None
    group_windows: list[int | None] = []
    layer_group = [0] * len(windows)
    layer_tensor = [0] * len(windows)
    for layers in (full, sliding):
        for start in range(0, len(layers), size):
            members = layers[start:start + size]
            for position, layer in enumerate(members):
                layer_group[layer] = len(group_windows)
                layer_tensor[layer] = position
            group_windows.append(None if windows[members[0]] is None else max(windows[i] for i in members))
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_tensor), size)
