"""Greedy sampling's argmax (engine/kernels/argmax.py) equals torch's on every kind of row."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

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


def _masked_reference(logits: torch.Tensor, bitmask: torch.Tensor, word_rows: list[int]) -> list[int]:
    """The sampler's other path: -inf over each constrained row's forbidden tokens of a copy, then max."""
    masked = logits.clone()
    vocab = logits.shape[1]
    for r, w in enumerate(word_rows):
        if w < 0:
            continue
        words = bitmask[w].tolist()
        for t in range(vocab):
            if t // 32 >= len(words) or not (words[t // 32] >> (t % 32)) & 1:
                masked[r, t] = float("-inf")
    return masked.max(dim=-1).indices.tolist()


@pytest.fixture(scope="module")
def scalar_build(tmp_path_factory):
    """csrc/argmax.c built without AVX-512: the path of CPUs that lack it."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    lib = tmp_path_factory.mktemp("scalar") / "argmax_scalar.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-fopenmp", "-mno-avx512f", "-o", str(lib),
                    str(argmax.SOURCE)], check=True)
    fn = ctypes.CDLL(str(lib)).argmax_rows_masked
    fn.argtypes, fn.restype = list(argmax._MASKED_ARGTYPES), None

    def run(logits, bitmask, word_rows):
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        index = torch.tensor(word_rows, dtype=torch.int64)
        fn(logits.data_ptr(), argmax.FLOAT_CODES[logits.dtype], logits.shape[0], logits.shape[1], logits.stride(0),
           bitmask.data_ptr(), bitmask.shape[1], index.data_ptr(), out.data_ptr(), 1)
        return out.tolist()
    return run


@pytest.mark.parametrize("build", ["native", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [5, 16, 33, 100, 1000])
def test_masked_argmax_equals_the_argmax_of_a_masked_copy(dtype, cols, build, request):
    gen = torch.Generator().manual_seed(cols)
    logits = torch.randn(9, cols, generator=gen).to(dtype)
    num_words = max(1, (cols - 3) // 32 + 1)  # fewer words than tokens where cols > 32: a padded vocabulary
    bitmask = torch.randint(-2**31, 2**31 - 1, (9, num_words), generator=gen, dtype=torch.int64).to(torch.int32)
    word_rows = [0, 1, -1, 3, 4, 5, 6, 7, 8]
    top = logits[0].float().argmax().item()  # forbid row 0's own maximum: the pick must move
    bitmask[0, top // 32] &= ~(1 << (top % 32)) if top // 32 < num_words else -1
    logits[3, : min(cols, 3)] = float("nan")  # a NaN at a forbidden token does not count; an allowed one does
    bitmask[3, 0] = 0b100
    bitmask[4] = 0  # every token forbidden: index 0, as the all -inf copy's argmax
    logits[5] = float("-inf")  # every allowed token -inf: index 0 too
    logits[6] = 1.0  # all equal: the first allowed token
    bitmask[7] = -1  # everything the words cover allowed, the padded tail not
    logits[7, cols - 1] = 100.0
    bitmask[8] = -1
    logits[8, 2] = logits[8, min(cols, 33) - 1] = 50.0  # a tie between allowed tokens
    if build == "scalar":
        got = request.getfixturevalue("scalar_build")(logits, bitmask, word_rows)
    else:
        got = argmax.argmax_rows_masked(logits, bitmask, word_rows)
        if got is None:
            pytest.skip("the C kernels are not built here (BATCHGEN_NO_NATIVE or no compiler)")
    assert got == _masked_reference(logits, bitmask, word_rows)
    assert got[2] == logits[2].max(dim=-1).indices.item()  # the unconstrained row: plain argmax


def test_masked_argmax_declines_what_it_cannot_run():
    """None, so that the sampler makes the masked copy instead."""
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)
    assert argmax.argmax_rows_masked(torch.randn(1, 8).half(), bitmask, [0]) is None
    assert argmax.argmax_rows_masked(torch.randn(8, 3).t(), bitmask, [0, 0, 0]) is None  # not unit-stride rows
    assert argmax.argmax_rows_masked(torch.randn(2, 8), bitmask, [0]) is None  # a word row per logits row
