"""Samples of one request (sampling.n > 1) in the scheduler, without a model: the prompt's full blocks
are computed once and shared, and no sample ever reads K/V its leader has not written (the fake KV
cache of test_scheduler.drive checks every slot read), under both policies, chunked prefill,
preemption and continuations."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.config.choices import Policy
from batchgen.engine.request import Continuation, Request, SamplingParams
from batchgen.engine.sequence import Sequence
from tests.engine.scheduler.test_scheduler import drive, make_scheduler


def make_samples(first_id: int, prompt: list[int], n: int, max_new_tokens: int,
                 continued: dict[int, tuple[int, ...]] | None = None) -> list[Sequence]:
    """The sequences the engine makes for one request with n samples: the first leads."""
    seqs = []
    for i in range(n):
        tokens = (continued or {}).get(i)
        request = Request(f"r{first_id}", list(prompt), SamplingParams(max_new_tokens=max_new_tokens, n=n),
                          sample_index=i, continuation=Continuation(tokens) if tokens else None)
        seq = Sequence.from_request(first_id + i, request)
        seq.prompt_leader = seqs[0] if seqs else None
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_prompts_full_blocks_are_computed_once(policy, prefix_caching):
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, policy=policy,
                           prefix_caching=prefix_caching)
    prompt = list(range(3, 21))  # 18 tokens: 4 full blocks, 2 tokens in a partial one
    seqs = make_samples(0, prompt, n=4, max_new_tokens=5)
    trace = drive(sched, seqs, rng=random.Random(0), max_steps=100)
    # the leader computes the whole prompt; each sibling its partial block only (2 tokens)
    assert trace.chunks[0][0] == 18
    for seq in seqs[1:]:
        assert trace.chunks[seq.seq_id][0] == 2
        assert seq.num_cached_prompt_tokens == 16
    assert sched.block_manager.num_prefix_hit_tokens == 3 * 16


def test_a_sibling_waits_for_a_leader_whose_prompt_is_chunked():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    seqs = make_samples(0, list(range(3, 31)), n=3, max_new_tokens=3)  # 28 tokens: 4 chunks of 8 at most
    trace = drive(sched, seqs, rng=random.Random(0), max_steps=100)
    assert sum(trace.chunks[0][:4]) == 28
    assert all(trace.chunks[s.seq_id][0] <= 4 for s in seqs[1:])  # the last block, recomputed


def test_a_leader_preempted_before_computing_takes_its_waiting_siblings_back_to_the_queue():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    seqs = make_samples(0, list(range(3, 15)), n=3, max_new_tokens=4)
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()  # the leader is scheduled; its siblings are admitted on its blocks, awaiting
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert [s.awaits_leader_tokens for s in seqs[1:]] == [12 - 4, 12 - 4]  # 11 // 4 full blocks shared
    sched.check_integrity()
    sched.preempt_all()  # as after a device OOM: the leader's blocks were never written
    sched.check_integrity()
    assert not sched.running and all(not s.block_table and not s.awaits_leader_tokens for s in seqs)
    trace = drive(sched, seqs, rng=random.Random(1), max_steps=100)
    assert trace.chunks[0][0] == 12 and trace.chunks[1][0] == trace.chunks[2][0] == 4


@st.composite
def sample_workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    num_blocks = draw(st.integers(4, 48))
    max_model_len = draw(st.integers(8, 120))
    max_prompt = min(num_blocks * block_size - 1, max_model_len - 1, 40)
    seqs: list[Sequence] = []
    for _ in range(draw(st.integers(1, 4))):
        length = draw(st.integers(1, max_prompt))
        prompt = draw(st.lists(st.integers(0, 2), min_size=length, max_size=length))
        n = draw(st.integers(1, 4))
        max_new = draw(st.integers(1, 12))
        # a continuation holds what an earlier run generated under the same max_model_len, which ends a
        # row at max_model_len tokens: prompt + continuation < max_model_len (a longer one is no state a
        # job can resume, and a static batch's reservation, capped at max_model_len, could not hold it)
        most_continued = min(max_new - 1, max_model_len - 1 - length)
        continued = {i: tuple(draw(st.lists(st.integers(0, 2), min_size=1, max_size=most_continued)))
                     for i in range(n) if most_continued >= 1 and draw(st.booleans())}
        seqs += make_samples(len(seqs), prompt, n, max_new, continued)
    config = dict(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                  max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 48)),
                  policy=draw(st.sampled_from(list(Policy))), prefix_caching=draw(st.booleans()))
    return config, seqs, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample_workloads())
def test_random_sample_groups_keep_every_invariant(workload):
    config, seqs, seed = workload
    sched = make_scheduler(**config)
    total = sum(s.max_num_tokens for s in seqs)
    drive(sched, seqs, rng=random.Random(seed), max_steps=20 * total * len(seqs) + 50, eos_prob=0.1)
