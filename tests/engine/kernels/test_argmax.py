"""Greedy sampling's argmax (engine/kernels/argmax.py) equals torch's on every kind of row."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.kernels import argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 15, 16, 17, 1000, 49152])
def test_matches_torch_max_indices(dtype, cols):
    gen = torch.Generator().manual_seed(cols)
    logits = torch.randn(7, cols, generator=gen).to(dtype)
    if cols > 3:
        logits[1, 2] = logits[1, cols - 1] = logits[1].max() + 1  # a tie: the first index wins
        logits[2] = 0.0  # all equal
        logits[3, cols // 2] = float("nan")  # NaN counts as the maximum
        logits[3, cols - 1] = float("nan")
        logits[4] = float("-inf")
        logits[5, 0] = float("inf")
        logits[5, cols - 2] = float("inf")
        logits[6, :] = -0.0
        logits[6, cols - 1] = 0.0
    assert argmax.argmax_rows(logits) == logits.max(dim=-1).indices.tolist()


def test_row_views_with_a_stride_and_other_dtypes():
    logits = torch.randn(6, 300)
    view = logits[::2, :257]  # rows 600 elements apart, fewer columns
    assert argmax.argmax_rows(view) == view.max(dim=-1).indices.tolist()
    half = torch.randn(3, 40).half()  # no kernel: torch's answer
    assert argmax.argmax_rows(half) == half.max(dim=-1).indices.tolist()
    columns = torch.randn(9, 5).t()  # a transposed view: not unit-stride rows, torch's answer
    assert argmax.argmax_rows(columns) == columns.max(dim=-1).indices.tolist()
