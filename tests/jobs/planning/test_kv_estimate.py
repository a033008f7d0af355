"""plan's KV estimate: every token of a row, unless every layer's window lets the engine return
the blocks behind it (continuous rows then hold their window plus one step's chunk)."""

from __future__ import annotations

from types import SimpleNamespace

from batchgen.config.choices import Policy
from batchgen.jobs.planning.estimate import kv_bytes


def plan(mode: Policy):
    rows = [SimpleNamespace(num_prompt_tokens=n, prediction=SimpleNamespace(p50=50, p90=100), num_samples=1)
            for n in (400, 300, 30)]
    return SimpleNamespace(rows=rows, static_batches=[3], mode=mode)


def test_a_window_caps_continuous_rows_and_leaves_static_reservations_whole():
    full = kv_bytes(plan(Policy.CONTINUOUS), 3, 16, 2)
    windowed = kv_bytes(plan(Policy.CONTINUOUS), 3, 16, 2, kv_window=64, budget=32)
    per_block = 16 * 2
    assert full["continuous"] == (29 + 22 + 5) * per_block  # ceil((prompt + p50) / 16) each
    assert windowed["continuous"] == (7 + 7 + 5) * per_block  # ceil((64 + 32) / 16) + 1, or the row if shorter
    assert windowed["static"] == full["static"] and windowed["needed"] == windowed["continuous"]


def test_kv_groups_count_a_block_per_group_and_window_bounded_sliding_blocks_static_too():
    from batchgen.engine.kv.groups import plan_groups, window_blocks

    groups = plan_groups([64, 64, 64, None])  # three sliding groups, one full, one layer each
    hybrid = kv_bytes(plan(Policy.CONTINUOUS), 3, 16, 2, budget=32, kv_groups=groups)
    per_block, bound = 16 * 2, window_blocks(64, 32, 16)
    assert hybrid["continuous"] == (29 + 3 * bound + 22 + 3 * bound + 5 * 4) * per_block
    static = kv_bytes(plan(Policy.STATIC), 3, 16, 2, budget=32, kv_groups=groups)
    # ceil((prompt + p90) / 16) in the full group, at most the window's blocks in each sliding one
    assert static["static"] == (32 + 3 * bound + 25 + 3 * bound + 9 + 3 * bound) * per_block


def test_samples_hold_the_prompts_partial_block_and_their_own_output():
    rows = [SimpleNamespace(num_prompt_tokens=40, prediction=SimpleNamespace(p50=10, p90=20), num_samples=3)]
    p = SimpleNamespace(rows=rows, static_batches=[1], mode=Policy.CONTINUOUS)
    per_block = 16 * 2
    # the first sample: ceil((40 + 10) / 16) = 4 blocks; each other: ceil((8 + 10) / 16) = 2
    assert kv_bytes(p, 8, 16, 2)["continuous"] == (4 + 2 + 2) * per_block
    assert kv_bytes(p, 2, 16, 2)["continuous"] == (4 + 2) * per_block  # the batch's two largest sequences
    assert kv_bytes(p, 8, 16, 2)["static"] == (4 + 2 + 2) * per_block  # ceil(60 / 16), ceil(28 / 16) x 2
