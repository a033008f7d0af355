"""csrc/sample_window.c: each row's window of largest logit / temperature values (descending, ties by
lower id), their ids and the row's logsumexp, against torch on the same logits."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.kernels.sample_window import sample_window


def reference(logits: torch.Tensor, temperature: torch.Tensor, window: int):
    x = logits / temperature[:, None]
    ids = torch.arange(x.shape[-1]).expand_as(x)
    # value descending, then id ascending: a stable sort of ids by -value
    order = torch.sort(-x, dim=-1, stable=True).indices[:, :window]
    return x.gather(1, order), ids.gather(1, order), torch.logsumexp(x, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size, window", [(49152, 256), (1000, 20), (300, 299)])
def test_window_values_ids_and_logsumexp_equal_torch(dtype, vocab_size, window):
    gen = torch.Generator().manual_seed(vocab_size)
    scale = torch.rand(24, 1, generator=gen) * 8 + 0.1  # peaked to flat rows; bf16 gives ties
    logits = (torch.randn(24, vocab_size, generator=gen) * scale).to(dtype)
    logits[3, : vocab_size // 2] = float("-inf")  # a masked half (min_tokens-like)
    temperature = torch.rand(24, generator=gen) * 1.5 + 0.3
    got = sample_window(logits, temperature, window)
    if got is None:
        pytest.skip("no C compiler: the torch path runs instead")
    values, ids, lse = got
    want_values, want_ids, want_lse = reference(logits, temperature, window)
    assert torch.equal(values, want_values)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-4)


def test_rows_with_fewer_finite_values_than_the_window_pad_with_minus_inf():
    logits = torch.full((2, 64), float("-inf"))
    logits[0, [5, 9]] = torch.tensor([1.0, 2.0])
    logits[1, :] = 0.0
    got = sample_window(logits, torch.ones(2), 8)
    if got is None:
        pytest.skip("no C compiler")
    values, ids, _ = got
    assert values[0, :2].tolist() == [2.0, 1.0] and ids[0, :2].tolist() == [9, 5]
    assert torch.isinf(values[0, 2:]).all()
    assert ids[1].tolist() == list(range(8))  # all tied: the lowest ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_whose_window_lies_past_every_cut_equal_torch(dtype):
    # logits spread over hundreds of nats: fewer than `window` values lie within the farthest cut
    # below the max, so the kernel takes every value as a candidate
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 4096, generator=gen) * torch.tensor([[300.0], [120.0], [40.0], [1.0]])).to(dtype)
    temperature = torch.tensor([0.5, 1.0, 0.2, 2.0])
    got = sample_window(logits, temperature, 64)
    if got is None:
        pytest.skip("no C compiler")
    values, ids, lse = got
    want_values, want_ids, want_lse = reference(logits, temperature, 64)
    assert torch.equal(values, want_values)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-4)
