"""csrc/token_bitmask.c: each constrained row's forbidden tokens at -inf, the others untouched, as
the grammar's torch unpack gives them."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.kernels.token_bitmask import apply_token_bitmask_
from batchgen.engine.sampling.grammar import _BYTE_TO_ADDEND


def torch_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    addend = _BYTE_TO_ADDEND[bitmask.view(torch.uint8).long()].reshape(len(rows), -1).to(logits.dtype)
    width = min(addend.shape[1], logits.shape[1])
    for m, r in enumerate(rows):
        out[r, :width] += addend[m, :width]
        out[r, width:] = float("-inf")  # past the grammar's vocabulary
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab_size, num_words", [(1000, 32), (1000, 30), (96, 3)])
def test_forbidden_tokens_are_minus_inf_and_the_rest_untouched(dtype, vocab_size, num_words):
    gen = torch.Generator().manual_seed(vocab_size + num_words)
    logits = torch.randn(6, vocab_size, generator=gen).to(dtype)
    rows = [0, 3, 4]
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, num_words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1, : num_words // 2] = -1  # words allowing all their tokens
    bitmask[2] = 0  # a row that allows nothing in its words
    got = logits.clone()
    if not apply_token_bitmask_(got, bitmask, rows):
        pytest.skip("no C compiler: the torch unpack runs instead")
    want = torch_reference(logits, bitmask, rows)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
    assert torch.equal(got[[1, 2, 5]], logits[[1, 2, 5]])  # unconstrained rows


def test_other_devices_and_dtypes_are_left_to_the_torch_unpack():
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    assert not apply_token_bitmask_(torch.zeros(1, 32, dtype=torch.float64), bitmask, [0])
    assert not apply_token_bitmask_(torch.zeros(1, 32), bitmask.to(torch.int64), [0])
