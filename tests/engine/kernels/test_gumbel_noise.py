"""csrc/gumbel_noise.c: the sampler's noise equals random_stream's torch ops on the same keys and ids."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.kernels.gumbel_noise import gumbel_noise
from batchgen.engine.sampling.random_stream import PERM_SALT, UNIFORM_BITS, gumbel, gumbel_torch, row_keys

VOCAB = 49152


@pytest.mark.parametrize("shared_ids", [False, True])
def test_kernel_noise_equals_the_torch_ops(shared_ids):
    gen = torch.Generator().manual_seed(3)
    seeds = torch.randint(-2**62, 2**62, (40,), generator=gen)
    positions = torch.randint(0, 5000, (40,), generator=gen)
    lo, hi = row_keys(seeds, positions)
    ids = torch.arange(VOCAB + 1) if shared_ids else torch.randint(0, VOCAB + 1, (40, 300), generator=gen)
    got = gumbel_noise(lo, hi, ids, PERM_SALT, UNIFORM_BITS)
    if got is None:
        pytest.skip("no C compiler: the torch ops run instead")
    want = gumbel_torch(lo, hi, ids, VOCAB)
    assert got.shape == want.shape
    # the integer hash and the uniform are exact; the two logarithms may differ in their last bits
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(gumbel(lo, hi, ids, VOCAB), got)  # the sampler's noise on the CPU is the kernel's


def test_other_devices_and_dtypes_take_the_torch_ops():
    lo, hi = row_keys(torch.arange(2), torch.zeros(2, dtype=torch.long))
    assert gumbel_noise(lo, hi, torch.arange(8, dtype=torch.int32), PERM_SALT, UNIFORM_BITS) is None
