"""plan's KV estimate: every token of a row, unless every layer's window lets the engine return
the blocks behind it (continuous rows then hold their window plus one step's chunk)."""

from __future__ import annotations

from types import SimpleNamespace

from batchgen.config.choices import Policy
from batchgen.jobs.planning.estimate import kv_bytes


def plan(mode: Policy):
    rows = [SimpleNamespace(num_prompt_tokens=n, prediction=SimpleNamespace(p50=50, p90=100)) for n in (400, 300, 30)]
    return SimpleNamespace(rows=rows, static_batches=[3], mode=mode)


def test_a_window_caps_continuous_rows_and_leaves_static_reservations_whole():
    full = kv_bytes(plan(Policy.CONTINUOUS), 3, 16, 2)
    windowed = kv_bytes(plan(Policy.CONTINUOUS), 3, 16, 2, kv_window=64, budget=32)
    per_block = 16 * 2
    assert full["continuous"] == (29 + 22 + 5) * per_block  # ceil((prompt + p50) / 16) each
    assert windowed["continuous"] == (7 + 7 + 5) * per_block  # ceil((64 + 32) / 16) + 1, or the row if shorter
    assert windowed["static"] == full["static"] and windowed["needed"] == windowed["continuous"]
