"""Layer groups of local/global models: how layers share the cache's tensors, and the block counts
a sequence holds."""

from __future__ import annotations

import random

from batchgen.engine.kv.groups import plan_groups, window_blocks


def test_one_window_or_none_is_one_group():
    assert plan_groups([None, None]) is None
    assert plan_groups([8, 8, 8]) is None


def test_a_rare_kind_of_layer_that_would_need_many_groups_keeps_all_kv():
    assert plan_groups([None] * 27 + [8]) is None  # 28 one-layer groups to save 1/28 of the cache
    assert plan_groups([None] * 21 + [8] * 7).num_groups == 4  # Qwen2 with max_window_layers 21


def test_alternating_layers_make_two_groups_sharing_one_tensor_per_position():
    groups = plan_groups([8, None, 8, None])  # Gemma 2, gpt-oss
    assert groups.group_windows == (None, 8)
    assert groups.layer_group == (1, 0, 1, 0)
    assert groups.layer_tensor == (0, 0, 1, 1)
    assert groups.num_tensors == 2


def test_five_local_to_one_global_makes_groups_of_the_global_count():
    windows = ([512] * 5 + [None]) * 4 + [512, 1024]  # Gemma 3 1B: 22 sliding, 4 full; one wider window
    groups = plan_groups(windows)
    assert groups.num_tensors == 4
    assert groups.group_windows == (None, 512, 512, 512, 512, 512, 1024)  # the last group keeps its widest
    for group in range(groups.num_groups):  # a group's layers sit in distinct tensors
        positions = [t for g, t in zip(groups.layer_group, groups.layer_tensor, strict=True) if g == group]
        assert len(positions) == len(set(positions)) <= groups.num_tensors


def test_blocks_held_and_the_longest_sequence():
    groups = plan_groups([12, None, 12, 12])  # one full layer, three sliding: four one-layer groups
    assert groups.num_groups == 4 and groups.num_tensors == 1
    bound = window_blocks(12, 16, 4)
    assert groups.blocks_held(8, 16, 4) == 4 * 2  # within the window: a block per group per block
    assert groups.blocks_held(400, 16, 4) == 100 + 3 * bound
    for num_blocks in (8, 40, 100 + 3 * bound, 1000):
        longest = groups.max_tokens(num_blocks, 16, 4)
        assert groups.blocks_held(longest, 16, 4) <= num_blocks < groups.blocks_held(longest + 4, 16, 4)


def test_window_blocks_bounds_what_a_sliding_sequence_holds():
    """Simulate a sequence growing by chunks of at most `chunk` tokens and dropping blocks out of the
    window after each step (kv/block_manager.py's rule): it never holds more than window_blocks."""
    rng = random.Random(0)
    for _ in range(300):
        window, chunk, block_size = rng.randint(1, 40), rng.randint(1, 40), rng.randint(1, 16)
        computed, most = rng.randint(0, 50), 0
        for _ in range(30):
            target = computed + rng.randint(1, chunk)
            first_kept = max(0, computed - window + 1) // block_size
            most = max(most, -(-target // block_size) - min(first_kept, -(-target // block_size)))
            computed = target
        assert most <= window_blocks(window, chunk, block_size), (window, chunk, block_size)
