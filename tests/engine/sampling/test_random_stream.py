"""The counter-based noise (engine/sampling/random_stream.py): the torch hash equals its plain-Python
definition, stays inside its bounds and looks uniform and independent across seeds and positions."""

from __future__ import annotations

import random

import torch

from batchgen.engine.sampling.random_stream import GUMBEL_MAX, GUMBEL_MIN, gumbel, gumbel_reference, row_keys

VOCAB = 49152


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def test_torch_hash_equals_the_python_definition():
    rng = random.Random(0)
    seeds = [0, 1, (1 << 63) - 1, (1 << 64) - 1, *(rng.getrandbits(64) for _ in range(12))]
    positions = [rng.randrange(0, 1 << 20) for _ in seeds]
    token_ids = torch.tensor([0, 1, 2, 4095, VOCAB - 1, *(rng.randrange(VOCAB) for _ in range(20))])
    lo, hi = row_keys(torch.tensor([_signed64(s) for s in seeds]), torch.tensor(positions))
    noise = gumbel(lo, hi, token_ids, VOCAB)
    for r, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        for c, token in enumerate(token_ids.tolist()):
            assert abs(noise[r, c].item() - gumbel_reference(seed, position, token)) < 1e-5, (seed, position, token)


def test_noise_is_bounded_and_gumbel_distributed():
    lo, hi = row_keys(torch.arange(64), torch.zeros(64, dtype=torch.long))
    noise = gumbel(lo, hi, torch.arange(VOCAB), VOCAB)  # [64, VOCAB]: 3.1M values
    assert torch.isfinite(noise).all()
    assert GUMBEL_MIN - 1e-4 <= noise.min().item() and noise.max().item() <= GUMBEL_MAX + 1e-3
    # Gumbel(0, 1): mean = Euler's gamma, variance = pi^2 / 6
    assert abs(noise.mean().item() - 0.5772) < 0.005
    assert abs(noise.var().item() - 1.6449) < 0.01
    u = torch.exp(-torch.exp(-noise.double()))  # back to the uniforms: a flat histogram
    counts = torch.histc(u, bins=100, min=0.0, max=1.0)
    expected = u.numel() / 100
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 150, chi2  # 99 degrees of freedom: p = 0.0006 at 150


def test_streams_of_neighbouring_seeds_and_positions_are_unrelated():
    token_ids = torch.arange(4096)
    seeds = torch.tensor([7, 8, 7, 7])
    positions = torch.tensor([0, 0, 1, 2])
    lo, hi = row_keys(seeds, positions)
    noise = gumbel(lo, hi, token_ids, VOCAB)
    corr = torch.corrcoef(noise)
    off_diagonal = corr[~torch.eye(4, dtype=torch.bool)]
    assert off_diagonal.abs().max().item() < 0.06, corr
    assert len({tuple(row.tolist()) for row in noise.argsort(-1)[:, -5:]}) == 4
