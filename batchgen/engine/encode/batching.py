"""Rows into static batches: sorted by length, each under a token budget.

Every row of an encode task is one forward pass of a known length, so a window of rows is sorted by
length and cut into batches whose token count stays under the budget: the batch's linears run on
exactly its tokens (packing), and the rows that share its attention layout differ little in length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchgen.config.choices import Task

# The default token budget of one forward. On the CPU, large enough that each linear is a big GEMM
# (MiniLM-sized models gain little past ~8K tokens a forward) and small enough that a batch's
# activations stay a few hundred MB for base-sized models.
DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU = 8192
DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA = 32768
# Rows one window sorts together before its batches run: windows this many budgets long keep batches
# full and well sorted while results still come back steadily.
WINDOW_BUDGETS = 16


def engine_prefill(task: str, device_type: str) -> bool:
    """Whether the encoder runs the task on the generation engine's prefill kernels (prefill.py: score on
    the CPU), whose attention has no padded layout, so that its batches are sized by real tokens."""
    return task == Task.SCORE and device_type == "cpu"


def plan_batches(lengths: Sequence[int], *, max_num_batched_tokens: int, max_num_seqs: int | None = None,
                 padded_attention: bool = True) -> list[np.ndarray]:
    """Indices into `lengths`, one array per batch, longest rows first. A batch's rows stay within
    `max_num_seqs`, and within `max_num_batched_tokens` its rows times its longest row where the
    attention runs a padded [rows, longest] layout (so that layout, and the real tokens, fit the
    budget), its real tokens where it runs none; a row longer than the budget runs alone."""
    assert max_num_batched_tokens >= 1 and (max_num_seqs is None or max_num_seqs >= 1)
    if not len(lengths):
        return []
    sizes = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    batches: list[np.ndarray] = []
    start = 0
    longest = tokens = 0
    for position, index in enumerate(order):
        rows = position - start + 1
        tokens += int(sizes[index])
        if position == start:
            longest = int(sizes[index])  # the batch's first row is its longest
        elif (rows * longest if padded_attention else tokens) > max_num_batched_tokens \
                or (max_num_seqs is not None and rows > max_num_seqs):
            batches.append(order[start:position])
            start, longest, tokens = position, int(sizes[index]), int(sizes[index])
    batches.append(order[start:])
    return batches
