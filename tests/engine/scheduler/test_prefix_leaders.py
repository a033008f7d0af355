"""Rows that share a prompt prefix (a document asked several questions), in the scheduler without a
model: the group's shared full blocks are computed once, by its leader, under both policies,
chunked prefill and preemption; a leader that finishes before its followers start keeps the shared
blocks pinned for them; and no follower ever reads K/V its leader has not written (test_scheduler.drive
checks every slot read)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from batchgen.config.choices import Policy
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.scheduler import samples
from batchgen.engine.sequence import Sequence
from tests.engine.scheduler.test_scheduler import drive, make_scheduler

BS = 4
DOC_TOKENS = 18  # 4 full blocks (16 tokens) are shared; the question starts in the fifth


def make_rows(docs: list[list[int]], questions: list[list[int]], max_new_tokens: int, *,
              linked: bool = True, first_id: int = 0) -> list[Sequence]:
    """Each document with each question, a document's rows together, its first row leading the rest
    (as LLMEngine.add_request links a request naming its prefix leader)."""
    seqs: list[Sequence] = []
    for doc in docs:
        leader = None
        for question in questions:
            seq_id = first_id + len(seqs)
            seq = Sequence.from_request(seq_id, Request(str(seq_id), doc + question,
                                                        SamplingParams(max_new_tokens=max_new_tokens)))
            if linked:
                samples.follow_prefix(seq, leader, BS)
            leader = leader or seq
            seqs.append(seq)
    return seqs


def documents(num_docs: int) -> list[list[int]]:
    return [[3 + d] + [20 + (d * 7 + i) % 200 for i in range(DOC_TOKENS - 1)] for d in range(num_docs)]


QUESTIONS = [[240, 241, 242], [243, 244], [245, 246, 247, 248], [249]]


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("budget", [8, 64])  # 8: every prompt is prefilled in chunks
def test_a_groups_shared_blocks_are_computed_once(policy, budget):
    sched = make_scheduler(num_blocks=64, block_size=BS, max_num_seqs=6, max_num_batched_tokens=budget,
                           policy=policy)
    seqs = make_rows(documents(3), QUESTIONS, max_new_tokens=3)
    trace = drive(sched, seqs, rng=random.Random(0), max_steps=200)
    for doc in range(3):
        leader, *followers = seqs[doc * 4:doc * 4 + 4]
        assert sum(trace.chunks[leader.seq_id]) >= leader.num_prompt_tokens
        assert leader.num_cached_prompt_tokens == 0
        for f in followers:  # 16 shared tokens from the leader, only its own rest computed
            assert f.num_cached_prompt_tokens == 16
            assert trace.chunks[f.seq_id][0] == min(f.num_prompt_tokens - 16, budget)


def test_unlinked_rows_admitted_together_each_compute_the_document():
    """What the grouping saves: the same rows with no leader, admitted in one step, compute it side by side."""
    sched = make_scheduler(num_blocks=64, block_size=BS, max_num_seqs=6, max_num_batched_tokens=64)
    seqs = make_rows(documents(1), QUESTIONS, max_new_tokens=3, linked=False)
    drive(sched, seqs, rng=random.Random(0), max_steps=200)
    assert [s.num_cached_prompt_tokens for s in seqs[:3]] == [0, 0, 0]  # the step's first three


def test_followers_preempted_keep_the_shared_blocks_computed_once():
    # 12 blocks: 4 rows of 6-7 blocks at most each cannot all grow, so the newest are preempted
    sched = make_scheduler(num_blocks=12, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = make_rows(documents(1), QUESTIONS, max_new_tokens=8)
    trace = drive(sched, seqs, rng=random.Random(0), max_steps=300)
    assert trace.num_preemptions > 0
    leader = seqs[0]
    assert leader.num_preemptions == 0  # the oldest runs on; its blocks stay
    # every block of the document was computed by the leader alone: each follower's attempts computed
    # at most its own tokens past the 16 shared ones
    for f in seqs[1:]:
        assert f.num_cached_prompt_tokens == 16
        assert sum(trace.chunks[f.seq_id]) <= (f.num_preemptions + 1) * (f.num_tokens - 16)


def test_a_finished_leaders_blocks_stay_pinned_until_its_follower_starts():
    """One row at a time. The leader finishes; an unrelated row finishes after it, so its cached blocks
    are newer than the document's; a long row then needs more blocks than the pool holds uncached.
    The least recently used cached blocks would go first, the document's: pinned, the unrelated row's
    go instead, and the follower still starts from the document's 4 blocks."""
    sched = make_scheduler(num_blocks=14, block_size=BS, max_num_seqs=1, max_num_batched_tokens=64)
    leader, follower = make_rows(documents(1), QUESTIONS[:2], max_new_tokens=2)
    newer = Sequence.from_request(8, Request("8", [100 + i for i in range(22)], SamplingParams(max_new_tokens=2)))
    long = Sequence.from_request(9, Request("9", [250 - i for i in range(34)], SamplingParams(max_new_tokens=2)))
    for seq in (leader, newer, long, follower):
        sched.add(seq)
    trace = drive(sched, [leader, newer, long, follower], rng=random.Random(0), max_steps=100)
    assert len(trace.finished) == 4 and not trace.out_of_memory
    assert long.num_cached_prompt_tokens == 0 and long.num_tokens == 9 * BS  # 9 of the 14 blocks
    assert follower.num_cached_prompt_tokens == 16
    assert trace.chunks[follower.seq_id][0] == follower.num_prompt_tokens - 16
    assert not sched.pins.held


def test_a_pin_gives_way_to_a_row_that_needs_the_whole_pool():
    sched = make_scheduler(num_blocks=14, block_size=BS, max_num_seqs=1, max_num_batched_tokens=64)
    leader, follower = make_rows(documents(1), QUESTIONS[:2], max_new_tokens=2)
    whole = Sequence.from_request(9, Request("9", [250 - i for i in range(50)], SamplingParams(max_new_tokens=6)))
    trace = drive(sched, [leader, whole, follower], rng=random.Random(0), max_steps=100)
    assert not trace.out_of_memory and whole.num_tokens == 14 * BS  # it had all 14 blocks
    assert follower.num_cached_prompt_tokens == 0  # its document was evicted for it


@st.composite
def group_workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(6, 48))
    max_model_len = draw(st.integers(12, 120))
    max_prompt = min(num_blocks * bs - 1, max_model_len - 1, 40)
    seqs: list[Sequence] = []
    for _ in range(draw(st.integers(1, 3))):
        doc = draw(st.lists(st.integers(0, 3), min_size=1, max_size=max_prompt - 1))
        leader = None
        for _ in range(draw(st.integers(1, 4))):
            rest = draw(st.lists(st.integers(0, 3), min_size=1, max_size=max(1, max_prompt - len(doc))))
            seq = Sequence.from_request(len(seqs), Request(str(len(seqs)), (doc + rest)[:max_prompt],
                                                           SamplingParams(max_new_tokens=draw(st.integers(1, 10)))))
            samples.follow_prefix(seq, leader, bs)
            leader = leader if leader is not None and draw(st.booleans()) else seq  # chains too
            seqs.append(seq)
    if draw(st.booleans()):
        random.Random(draw(st.integers(0, 99))).shuffle(seqs)  # a follower may come before its leader
    config = dict(num_blocks=num_blocks, block_size=bs, max_model_len=max_model_len,
                  max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 48)),
                  policy=draw(st.sampled_from(list(Policy))), prefix_caching=draw(st.booleans()))
    return config, seqs, draw(st.integers(0, 2**32 - 1))


def chained_leaders() -> tuple[dict, list[Sequence], int]:
    """A chain of leaders (0 <- 1 <- 2 <- 3) admitted in one step: row 2 awaits row 1's blocks, so
    row 3, which forks row 2's, must await them too, although row 2 counts them as computed."""
    prompts = [[0, 0], [0, 0], [0, 0, 0], [0, 0, 0], [0, 0]]
    seqs = [Sequence.from_request(i, Request(str(i), p, SamplingParams(max_new_tokens=1)))
            for i, p in enumerate(prompts)]
    for follower, leader in ((1, 0), (2, 1), (3, 2)):
        samples.follow_prefix(seqs[follower], seqs[leader], 1)
    config = dict(num_blocks=6, block_size=1, max_model_len=12, max_num_seqs=4, max_num_batched_tokens=3,
                  policy=Policy.CONTINUOUS, prefix_caching=False)
    return config, seqs, 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group_workloads())
@example(chained_leaders())
def test_random_prefix_groups_keep_every_invariant(workload):
    config, seqs, seed = workload
    sched = make_scheduler(**config)
    total = sum(s.max_num_tokens for s in seqs)
    drive(sched, seqs, rng=random.Random(seed), max_steps=20 * total * len(seqs) + 50, eos_prob=0.1)
    assert not sched.pins.held
