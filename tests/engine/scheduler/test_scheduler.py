"""Scheduler + BlockManager driven without a model: fake sampled tokens, invariants after every step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.config.choices import Policy
from batchgen.engine.kv.block_manager import BlockManager
from batchgen.engine.request import FinishReason, Request, SamplingParams
from batchgen.engine.scheduler.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceStatus


def make_seq(seq_id: int, prompt: list[int], max_new_tokens: int, predicted: int | None = None) -> Sequence:
    request = Request(str(seq_id), list(prompt), SamplingParams(max_new_tokens=max_new_tokens),
                      predicted_num_output_tokens=predicted)
    return Sequence.from_request(seq_id, request)


def make_scheduler(*, num_blocks: int, block_size: int, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 10_000,
                   policy: Policy = Policy.CONTINUOUS, prefix_caching: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len, policy=policy)


def prefix_keys(token_ids: list[int]) -> list[int]:
    """key[p] identifies tokens [0, p]: what the K/V at position p depend on."""
    keys, h = [], 0
    for t in token_ids:
        h = hash((h, t))
        keys.append(h)
    return keys


@dataclass
class Trace:
    finished: dict[int, FinishReason] = field(default_factory=dict)
    out_of_memory: list[int] = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    max_batched_tokens: int = 0
    max_running: int = 0
    chunks: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> chunk sizes scheduled


def drive(sched: Scheduler, seqs: list[Sequence], *, rng: random.Random, max_steps: int,
          eos_prob: float = 0.0) -> Trace:
    """Run the scheduler to the end with fake tokens, checking the invariants after every step.

    A fake KV cache records, for every slot written, the identity of the token prefix that
    produced it; each scheduled chunk must find its whole computed past there, so a block shared
    through the prefix cache, reused after eviction, or freed by preemption is caught the moment a
    sequence would read wrong K/V.
    """
    bm = sched.block_manager
    bs = bm.block_size
    fake_kv: dict[int, int] = {}  # slot -> prefix key of the token whose K/V it holds
    trace = Trace()
    for seq in seqs:
        if not any(seq is queued for queued in sched.waiting):  # a caller may have queued it already
            sched.add(seq)
    while sched.has_unfinished():
        trace.num_steps += 1
        assert trace.num_steps <= max_steps, "the scheduler does not finish its work"
        running_before = {s.seq_id: s.num_computed_tokens for s in sched.running}
        overruns_before = {s.seq_id: s.num_overruns for s in sched.running}
        out = sched.schedule()
        sched.check_integrity()

        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        trace.max_batched_tokens = max(trace.max_batched_tokens, out.num_batched_tokens)
        trace.max_running = max(trace.max_running, len(sched.running))
        trace.num_preemptions += out.num_preempted
        if sched.policy is Policy.STATIC:
            assert out.num_preempted == 0, "the static policy preempted"
            admitted = {s.seq_id for s in sched.running} - running_before.keys()
            # a new batch starts only once every member of the last one has left (finished,
            # parked after overrunning its predicted reservation, or out of memory)
            still_running = {s.seq_id for s in sched.running
                             if s.seq_id in running_before and s.num_overruns == overruns_before[s.seq_id]}
            assert not admitted or not still_running, "static admitted while a batch was running"
        assert out.scheduled or out.out_of_memory, "a step with work left scheduled nothing"

        for seq in out.out_of_memory:
            # only a sequence that cannot fit the whole cache on its own may be given up on
            assert seq.num_tokens > bm.num_blocks * bs
            sched.finish(seq, FinishReason.LENGTH)
            trace.out_of_memory.append(seq.seq_id)
            trace.finished[seq.seq_id] = FinishReason.LENGTH

        scheduled_ids = [s.seq.seq_id for s in out.scheduled]
        assert len(scheduled_ids) == len(set(scheduled_ids))
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            assert n >= 1 and start + n <= seq.num_tokens
            if seq.num_overruns != overruns_before.get(seq.seq_id, seq.num_overruns):
                # parked and restarted in the same step: recomputed from 0 or a prefix-cache hit
                assert start % bs == 0 and start < seq.num_tokens
            elif seq.seq_id in running_before:  # in order, no gap, no repeat
                assert start == running_before[seq.seq_id]
            else:  # freshly admitted: from 0 or from a prefix-cache hit of whole blocks
                assert start % bs == 0 and start < seq.num_tokens
            assert s.samples == (start + n == seq.num_tokens)
            assert len(seq.block_table) * bs >= start + n
            keys = prefix_keys(seq.token_ids[:start + n])
            for p in range(start):  # the past it attends to is its own
                slot = seq.block_table[p // bs] * bs + p % bs
                assert fake_kv.get(slot) == keys[p], f"seq {seq.seq_id} reads wrong K/V at {p}"
            for p in range(start, start + n):
                fake_kv[seq.block_table[p // bs] * bs + p % bs] = keys[p]
            trace.chunks.setdefault(seq.seq_id, []).append(n)

        samplers = out.samplers
        sampled = [rng.randrange(3) for _ in samplers]
        assert sched.update(out, sampled) == samplers
        for seq in samplers:
            params = seq.request.sampling
            reason = None
            if rng.random() < eos_prob:
                reason = FinishReason.STOP
            elif seq.num_generated_tokens >= params.max_new_tokens or seq.num_tokens >= sched.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                sched.finish(seq, reason)
                trace.finished[seq.seq_id] = reason
        sched.check_integrity()

    assert len(trace.finished) == len(seqs), "a request vanished"
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_integrity([])
    return trace


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    num_blocks = draw(st.integers(2, 40))
    capacity = num_blocks * block_size
    max_model_len = draw(st.integers(4, 120))
    # the engine rejects a prompt that leaves no room to generate; mirror that here
    max_prompt = min(capacity - 1, max_model_len - 1, 48)
    shared = draw(st.lists(st.integers(0, 2), max_size=3 * block_size))
    num_seqs = draw(st.integers(1, 10))
    seqs = []
    for i in range(num_seqs):
        length = draw(st.integers(1, max_prompt))
        prompt = (shared if draw(st.booleans()) else []) + draw(st.lists(st.integers(0, 2), min_size=length,
                                                                         max_size=length))
        # a planner's guess, often wrong: static reservations then overrun and park
        predicted = draw(st.one_of(st.none(), st.integers(1, 30)))
        seqs.append(make_seq(i, prompt[:length], draw(st.integers(1, 24)), predicted))
    config = dict(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 64)),
        policy=draw(st.sampled_from(list(Policy))), prefix_caching=draw(st.booleans()),
    )
    return config, seqs, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from([0.0, 0.1]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    config, seqs, seed, eos_prob = workload
    sched = make_scheduler(**config)
    total = sum(s.max_num_tokens for s in seqs)
    trace = drive(sched, seqs, rng=random.Random(seed), max_steps=20 * total * len(seqs) + 50,
                  eos_prob=eos_prob)
    assert trace.max_batched_tokens <= config["max_num_batched_tokens"]
    assert trace.max_running <= config["max_num_seqs"]
    capacity = config["num_blocks"] * config["block_size"]
    for seq in seqs:
        if seq.seq_id in trace.out_of_memory:
            assert min(seq.max_num_tokens, config["max_model_len"]) > capacity
        elif seq.finish_reason is FinishReason.LENGTH:
            assert (seq.num_generated_tokens == seq.request.sampling.max_new_tokens
                    or seq.num_tokens >= config["max_model_len"])


# ---- focused cases ------------------------------------------------------------------------------

def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    seq = make_seq(0, list(range(30)), max_new_tokens=3)
    trace = drive(sched, [seq], rng=random.Random(0), max_steps=100)
    assert trace.chunks[0] == [8, 8, 8, 6, 1, 1]  # four prefill chunks, then one token per step
    assert seq.num_generated_tokens == 3


def test_a_chunked_prompt_only_samples_on_its_last_chunk():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    seq = make_seq(0, list(range(20)), max_new_tokens=5)
    sched.add(seq)
    samples = []
    for _ in range(3):
        out = sched.schedule()
        samples.append([s.samples for s in out.scheduled])
        sched.update(out, [7] * len(out.samplers))
    assert samples == [[False], [False], [True]]
    assert seq.token_ids[-1] == 7 and seq.num_computed_tokens == 20


def test_running_sequences_share_the_budget_with_new_ones():
    # a decode token of a running sequence is served before a waiting prompt's chunk
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    a, b = make_seq(0, list(range(9)), 5), make_seq(1, list(range(100, 120)), 5)
    sched.add(a)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 9)]
    sched.update(out, [1])
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 9)]


def _step(sched: Scheduler) -> list[tuple[int, int]]:
    out = sched.schedule()
    sched.update(out, [7] * len(out.samplers))
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


@pytest.mark.parametrize("policy", [Policy.CONTINUOUS, Policy.STATIC])
def test_a_prompt_that_fits_a_whole_step_waits_for_it_and_shorter_ones_fill_the_gap(policy):
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=10, policy=policy)
    for i, n in enumerate((8, 6, 2)):
        sched.add(make_seq(i, list(range(10 * i, 10 * i + n)), 3))
    first = _step(sched)
    if policy is Policy.STATIC:  # all three run from the start: the 2-token prompt takes the gap
        assert first == [(0, 8), (2, 2)]
        assert _step(sched) == [(0, 1), (1, 6), (2, 1)]
    else:  # queue order: the 6-token prompt is admitted first, whole, next step
        assert first == [(0, 8)]
        assert _step(sched) == [(0, 1), (1, 6), (2, 2)]


def test_a_prompt_longer_than_a_step_is_still_chunked_and_deferrals_are_bounded():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    for i in range(4):
        sched.add(make_seq(i, [i], 20))
    _step(sched)  # four 1-token prompts: each decodes one token a step from now on
    sched.add(make_seq(9, list(range(100, 108)), 3))  # 8 tokens: never whole beside 4 decodes
    steps = [dict(_step(sched)).get(9) for _ in range(4)]
    assert steps == [None, None, 6, 2]  # waits twice, then is split as before
    sched.add(make_seq(10, list(range(200, 230)), 3))  # 30 tokens: longer than any step, chunked at once
    assert dict(_step(sched))[10] == 5


def test_preemption_takes_the_newest_and_recomputes_it_later():
    # 6 blocks of 4 tokens; three sequences of 7 tokens take 2 blocks each; the first to need
    # a third block forces a preemption
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    seqs = [make_seq(i, [i] * 7, max_new_tokens=6) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    sched.watermark_blocks = 0  # admit all three at once
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 2]
    sched.update(out, [5, 5, 5])  # now 8 tokens each: the 8th token still fits in block 2

    out = sched.schedule()
    sched.update(out, [6, 6, 6])  # 9 tokens each: the next step needs a third block each
    assert out.num_preempted == 0

    newest = seqs[2]
    tokens_before = list(newest.token_ids)
    out = sched.schedule()
    assert out.num_preempted == 1
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert newest.status is SequenceStatus.WAITING and sched.waiting[0] is newest
    assert newest.block_table == [] and newest.num_computed_tokens == 0
    assert newest.num_preemptions == 1 and sched.num_preemptions == 1
    assert newest.token_ids == tokens_before  # generated tokens are kept, only K/V is dropped
    sched.check_integrity()
    sched.update(out, [7, 7])

    # it comes back once the others are done and recomputes all its tokens, the generated too
    readmitted = None
    for _ in range(100):
        if newest.status is SequenceStatus.RUNNING:
            break
        for seq in seqs[:2]:
            if seq.status is SequenceStatus.RUNNING and seq.num_generated_tokens >= 6:
                sched.finish(seq, FinishReason.LENGTH)
        out = sched.schedule()
        sched.check_integrity()
        for s in out.scheduled:
            if s.seq is newest:
                readmitted = s
        sched.update(out, [1] * len(out.samplers))
    assert readmitted is not None and readmitted.num_new_tokens == len(tokens_before)
    assert newest.token_ids[:len(tokens_before)] == tokens_before


def test_preempted_sequence_hits_its_own_cached_prefix_on_return():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, prefix_caching=True)
    seqs = [make_seq(i, [i] * 7, max_new_tokens=14) for i in range(3)]  # 21 tokens: each fits alone
    sched.watermark_blocks = 0
    trace = drive(sched, seqs, rng=random.Random(1), max_steps=500)
    assert trace.num_preemptions >= 1
    assert sched.block_manager.num_prefix_hit_tokens > 0


def test_a_running_sequence_that_outgrows_the_cache_ends_as_out_of_memory():
    # 4 blocks x 4 tokens: prompt 10 + 20 new tokens can never fit; it must not hang or crash
    sched = make_scheduler(num_blocks=4, block_size=4)
    seq = make_seq(0, list(range(10)), max_new_tokens=20)
    trace = drive(sched, [seq], rng=random.Random(0), max_steps=100)
    assert trace.out_of_memory == [0]
    assert seq.num_tokens == 17  # 16 tokens computed fill the cache; the 17th has no slot
    assert sched.block_manager.num_free_blocks == 4


def test_out_of_memory_sequence_releases_blocks_for_others():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=1)
    big = make_seq(0, list(range(10)), max_new_tokens=20)
    small = make_seq(1, [1, 2, 3], max_new_tokens=4)
    trace = drive(sched, [big, small], rng=random.Random(0), max_steps=100)
    assert trace.out_of_memory == [0]
    assert small.finish_reason is FinishReason.LENGTH and small.num_generated_tokens == 4


def test_a_prompt_larger_than_the_cache_ends_as_out_of_memory():
    # the engine rejects such a prompt up front; the scheduler alone must still not hang
    sched = make_scheduler(num_blocks=2, block_size=4)
    seq = make_seq(0, list(range(12)), max_new_tokens=2)
    sched.add(seq)
    out = sched.schedule()
    assert out.out_of_memory == [seq] and not out.scheduled
    sched.finish(seq, FinishReason.LENGTH)
    assert not sched.has_unfinished()
    sched.check_integrity()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_static_policy_runs_whole_batches_without_preempting(prefix_caching):
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=3, policy=Policy.STATIC,
                           prefix_caching=prefix_caching)
    seqs = [make_seq(i, [1, 2, 3, 4, 5][: 1 + i % 5], max_new_tokens=3 + 2 * i) for i in range(7)]
    trace = drive(sched, seqs, rng=random.Random(0), max_steps=500)
    assert trace.num_preemptions == 0 and trace.max_running == 3


def test_static_policy_with_a_request_too_big_for_its_reservation():
    # 8 blocks x 4 tokens. The first request cannot reserve prompt + max_new_tokens (50 > 32
    # tokens), so it is admitted with its prompt only; a batch-mate holding a full reservation
    # would then have to be preempted when it grows. It must run alone instead.
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, policy=Policy.STATIC)
    big = make_seq(0, list(range(10)), max_new_tokens=40)
    small = [make_seq(i, [i], max_new_tokens=12) for i in range(1, 4)]
    trace = drive(sched, [big, *small], rng=random.Random(0), max_steps=500)
    assert trace.num_preemptions == 0
    assert trace.out_of_memory == [0] and big.num_tokens == 33
    assert all(s.num_generated_tokens == 12 for s in small)


def test_static_overrun_parks_the_row_and_finishes_it_later():
    """A predicted reservation that is too small never cuts a row short or touches batch-mates."""
    from batchgen.engine.request import Request, SamplingParams
    from batchgen.engine.sequence import Sequence

    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, policy=Policy.STATIC)
    seqs = []
    for i, predicted in enumerate([2, 20, 20]):
        req = Request(str(i), [7] * 6, SamplingParams(max_new_tokens=20), predicted_num_output_tokens=predicted)
        seqs.append(Sequence.from_request(i, req))
        sched.add(seqs[-1])
    finished, steps, parked = [], 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        parked += out.num_overruns
        assert out.num_preempted == 0
        sched.update(out, [1] * len(out.samplers))
        for seq in out.samplers:
            if seq.num_generated_tokens >= seq.request.sampling.max_new_tokens:
                sched.finish(seq, FinishReason.LENGTH)
                finished.append(seq.seq_id)
        sched.check_integrity()
        steps += 1
        assert steps < 500
    assert parked == 1 and seqs[0].num_overruns == 1
    assert all(s.num_generated_tokens == 20 for s in seqs)
    assert finished[-1] == 0  # the overrun row finished last, in a later batch
    assert bm.num_free_blocks == bm.num_blocks
