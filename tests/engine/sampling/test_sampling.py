"""Sampler: greedy, top-k, top-p, temperature, and per-request seeded streams.

A row's draw depends on its seed and its output index, so `draws` appends each token to the row as
the engine does: the next call draws the next token of the same stream."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sequence import Sequence

VOCAB = 50


def seq(seq_id: int, **params) -> Sequence:
    return Sequence.from_request(seq_id, Request(str(seq_id), [1], SamplingParams(**params)))


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draws(sampler: Sampler, logits_row: torch.Tensor, s: Sequence, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(sampler.sample(logits_row[None], [s])[0])
        s.token_ids.append(out[-1])
    return out


def kept(row: torch.Tensor, window: int = 256, **params) -> torch.Tensor:
    """Which tokens a draw with these settings may pick: [vocab_size] bool (read from the window,
    which a draw keeps when its row asks for logprobs)."""
    sampler = Sampler(window=window)
    sampler.sample(row[None], [seq(0, temperature=1.0, seed=0, logprobs=0, **params)])
    drawn = sampler.last_draw
    mask = torch.zeros(row.shape[-1], dtype=torch.bool)
    mask[drawn.value_ids[0][torch.isfinite(drawn.values[0])]] = True
    return mask


def _top_k_top_p(row: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """The row with the tokens top-k and top-p drop set to -inf (the tests' view of the masks)."""
    return row.masked_fill(~kept(row, top_k=top_k, top_p=top_p), float("-inf"))


def test_greedy_is_argmax():
    logits = random_logits(8)
    seqs = [seq(i) for i in range(8)]
    assert Sampler().sample(logits, seqs) == logits.argmax(-1).tolist()
    assert Sampler().sample(torch.empty(0, VOCAB), []) == []


def test_greedy_rows_stay_argmax_next_to_sampled_rows():
    logits = random_logits(6, seed=1)
    seqs = [seq(i, temperature=1.5, seed=i) if i % 2 else seq(i) for i in range(6)]
    out = Sampler().sample(logits, seqs)
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_top_k_1_is_greedy():
    logits = random_logits(16, seed=2)
    seqs = [seq(i, temperature=2.0, top_k=1, seed=i) for i in range(16)]
    sampler = Sampler()
    for _ in range(5):
        assert sampler.sample(logits, seqs) == logits.argmax(-1).tolist()
        for s in seqs:
            s.token_ids.append(0)


def test_top_k_keeps_the_k_largest():
    row = torch.tensor([0.0, 5.0, 1.0, 4.0, 3.0, 2.0])
    masked = _top_k_top_p(row, top_k=3, top_p=1.0)
    assert torch.isinf(masked[[0, 2, 5]]).all() and torch.equal(masked[[1, 3, 4]], row[[1, 3, 4]])
    s = seq(0, temperature=1.0, top_k=3, seed=0)
    sampler = Sampler()
    assert set(draws(sampler, row, s, 300)) == {1, 3, 4}


def test_top_p_masks_the_tail():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    row = probs.log()
    # keep tokens until the mass before them reaches top_p: 0.5 and 0.3 (mass before 0.15 is 0.8)
    kept = ~torch.isinf(_top_k_top_p(row, top_k=None, top_p=0.75))
    assert kept.tolist() == [False, True, False, True]
    kept = ~torch.isinf(_top_k_top_p(row, top_k=None, top_p=0.85))
    assert kept.tolist() == [False, True, True, True]
    kept = ~torch.isinf(_top_k_top_p(row, top_k=None, top_p=0.01))
    assert kept.tolist() == [False, True, False, False]  # the top token always stays
    assert not torch.isinf(_top_k_top_p(row, top_k=None, top_p=1.0)).any()

    sampler = Sampler()
    s = seq(0, temperature=1.0, top_p=0.75, seed=3)
    counts = collections.Counter(draws(sampler, row, s, 400))
    assert set(counts) == {1, 3}
    # renormalised over the kept tokens: 0.5 / 0.8 and 0.3 / 0.8
    assert abs(counts[1] / 400 - 0.625) < 0.08


def test_top_k_and_top_p_combine():
    row = torch.tensor([4.0, 3.0, 2.9, 2.8, -1.0])
    # top-p alone: p = .50 .18 .17 .15 .00; the mass before the 4th token is .85 >= .7
    assert (~torch.isinf(_top_k_top_p(row, None, 0.7))).tolist() == [True, True, True, False, False]
    # top-k first, then top-p on the renormalised rest: p = .59 .22 .20; before the 3rd: .80
    masked = _top_k_top_p(row, top_k=3, top_p=0.7)
    assert (~torch.isinf(masked)).tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution(temperature):
    row = torch.tensor([0.0, math.log(3.0)])  # p = 1/4, 3/4 at temperature 1
    expected = 3 ** (1 / temperature) / (1 + 3 ** (1 / temperature))
    s = seq(0, temperature=temperature, seed=11)
    n = 2000
    freq = sum(draws(Sampler(), row, s, n)) / n
    assert abs(freq - expected) < 0.04, (freq, expected)


def test_low_temperature_approaches_greedy_and_high_spreads():
    logits = random_logits(1, seed=5)[0]
    cold = seq(0, temperature=1e-3, seed=1)
    assert set(draws(Sampler(), logits, cold, 50)) == {int(logits.argmax())}
    hot = seq(1, temperature=50.0, seed=1)
    assert len(set(draws(Sampler(), logits, hot, 200))) > VOCAB // 2


def test_same_seed_same_stream_other_seed_other_stream():
    row = torch.zeros(VOCAB)  # uniform: every draw depends on the stream alone

    def stream(seed: int, seq_id: int = 0) -> list[int]:
        return draws(Sampler(), row, seq(seq_id, temperature=1.0, seed=seed), 30)

    assert stream(42) == stream(42)
    assert stream(42) == stream(42, seq_id=9)  # the seed, not the engine's id, picks the stream
    assert stream(42) != stream(43)


def test_a_seeded_row_does_not_depend_on_its_batch():
    logits = random_logits(5, seed=9)
    target_params = dict(temperature=0.8, top_p=0.9, top_k=20, seed=1234)
    alone = []
    sampler = Sampler()
    target = seq(0, **target_params)
    alone = draws(sampler, logits[2], target, 20)

    sampler = Sampler()
    batch = [seq(1, temperature=1.0, seed=7), seq(2), seq(3, **target_params), seq(4, temperature=1.3),
             seq(5, temperature=0.5, top_k=3, seed=1)]
    in_batch = []
    for _ in range(20):
        tokens = sampler.sample(logits, batch)
        in_batch.append(tokens[2])
        for s, token in zip(batch, tokens, strict=True):
            s.token_ids.append(token)
    assert in_batch == alone


def test_a_draw_depends_on_the_output_index_only():
    """No state: a recomputed (preempted) or continued row draws again what it drew at that index."""
    row = torch.zeros(VOCAB)
    sampler = Sampler()
    s = seq(0, temperature=1.0, seed=5)
    first = draws(sampler, row, s, 10)
    again = seq(1, temperature=1.0, seed=5)
    again.token_ids.extend(first[:4])  # the first four generated before, as a continuation holds them
    assert draws(Sampler(), row, again, 6) == first[4:]


def test_unseeded_rows_get_independent_streams_that_a_rerun_repeats():
    row = torch.zeros(VOCAB)
    sampler = Sampler()
    a, b = seq(0, temperature=1.0), seq(1, temperature=1.0)
    stream_a, stream_b = draws(sampler, row, a, 30), draws(sampler, row, b, 30)
    assert stream_a != stream_b
    assert draws(Sampler(), row, seq(0, temperature=1.0), 30) == stream_a  # the seed comes from the request id
