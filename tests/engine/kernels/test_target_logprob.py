"""score's target log-probabilities (engine/kernels/target_logprob.py) equal torch's log_softmax."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.kernels import paged_decode, target_logprob

pytestmark = pytest.mark.skipif(paged_decode.load() is None, reason="no C compiler")


def _torch(logits, targets):
    return logits.float().log_softmax(-1).gather(1, targets[:, None])[:, 0].double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 15, 16, 1000, 1024, 3000, 49152])
def test_equals_log_softmax(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    logits = (torch.randn(37, cols, generator=g) * 6).to(dtype)
    targets = torch.randint(0, cols, (37,), generator=g)
    got = target_logprob.target_logprobs(logits, targets)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _torch(logits, targets), rtol=1e-6, atol=2e-6)


def test_strided_rows_and_special_values():
    wide = torch.randn(6, 300, dtype=torch.bfloat16)
    logits = wide[:, 10:210]  # rows 300 elements apart
    logits[1, 5] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("-inf")
    logits[4, 9] = float("inf")
    targets = torch.tensor([3, 0, 1, 7, 8, 199])
    got = target_logprob.target_logprobs(logits, targets).tolist()
    want = _torch(logits, targets).tolist()
    assert math.isnan(got[1]) and math.isnan(got[2]) and math.isnan(want[1]) and math.isnan(want[2])
    assert got[3] == want[3] == -math.inf
    assert math.isnan(got[4]) and math.isnan(want[4])  # inf - inf in the sum
    assert got[0] == pytest.approx(want[0], abs=2e-6) and got[5] == pytest.approx(want[5], abs=2e-6)
