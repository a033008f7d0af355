"""Batches: longest rows first, rows x longest within the token budget, every row exactly once."""

from __future__ import annotations

import numpy as np

from batchgen.engine.encode.batching import engine_prefill, plan_batches


def test_batches_sort_by_length_and_keep_the_padded_layout_within_the_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=500).tolist() + [1000]
    batches = plan_batches(lengths, max_num_batched_tokens=512, max_num_seqs=64)
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    in_order = [lengths[i] for i in seen]
    assert in_order == sorted(lengths, reverse=True)
    for batch in batches:
        sizes = [lengths[i] for i in batch]
        assert len(batch) <= 64
        assert len(batch) * max(sizes) <= 512 or len(batch) == 1  # the 1000-token row runs alone
    assert [lengths[i] for i in batches[0]] == [1000]
    # full batches: a batch closes only when one more row would pass the budget or the row cap
    for batch, following in zip(batches[:-1], batches[1:], strict=True):
        longest = lengths[batch[0]]
        assert (len(batch) + 1) * longest > 512 or len(batch) == 64, (batch, following)
    assert plan_batches([], max_num_batched_tokens=8) == []


def test_without_a_padded_layout_batches_fill_the_budget_with_real_tokens():
    """score on the CPU (the engine's prefill kernels) attends without a [rows, longest] layout: a batch
    holds up to the budget's real tokens, so mixed lengths run in fewer batches."""
    lengths = [40, 20, 20, 20, 3, 1, 100]
    batches = plan_batches(lengths, max_num_batched_tokens=64, padded_attention=False)
    assert [[lengths[i] for i in b] for b in batches] == [[100], [40, 20], [20, 20, 3, 1]]
    assert len(plan_batches(lengths, max_num_batched_tokens=64)) == 4  # [100], [40], [20, 20, 20], [3, 1]
    assert engine_prefill("score", "cpu") and not engine_prefill("score", "cuda")
    assert not engine_prefill("embed", "cpu") and not engine_prefill("classify", "cpu")
