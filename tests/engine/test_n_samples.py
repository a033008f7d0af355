"""n samples per request in the real engine (a tiny random-weight float32 model): the prompt's full
blocks are computed once and shared, the n streams differ, and each sample is reproducible, batch
invariant, the same when asked for alone (sample_index), under preemption and when continued."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from batchgen.config.choices import Policy
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Completion, Request, SamplingParams
from batchgen.engine.sampling.sampler import sample_seed
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BLOCK_SIZE = 4
PROMPT = [7 + (i * 37) % 250 for i in range(18)]  # 4 full blocks and 2 tokens of a fifth
SAMPLED = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=11, n=4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny_model("llama").eval()


def engine(model, tokenizer, policy=Policy.CONTINUOUS, *, max_num_seqs=8, num_kv_blocks=128,
           prefix_caching=True, budget=None) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(
        policy=policy, num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching, adaptive_threads=False),
        eos_token_ids=[2])


def others(k: int = 6) -> list[Request]:
    rng = random.Random(5)
    return [Request(f"other-{i}", [rng.randrange(5, 261) for _ in range(rng.randint(3, 14))],
                    SamplingParams(max_new_tokens=16, temperature=0.9, seed=100 + i, n=1 + i % 3)) for i in range(k)]


def by_sample(completions) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    for c in completions:
        assert (c.request_id, c.sample_index) not in out, "a sample came out twice"
        out[c.request_id, c.sample_index] = c.token_ids
    return out


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n4_computes_the_prompts_full_blocks_once_and_gives_four_streams(model, tokenizer, policy, prefix_caching):
    eng = engine(model, tokenizer, policy, prefix_caching=prefix_caching)
    done = list(eng.generate([Request("row", PROMPT, SAMPLED)]))
    assert sorted(c.sample_index for c in done) == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in done}) == 4, "the samples drew the same stream"
    full = (len(PROMPT) // BLOCK_SIZE) * BLOCK_SIZE  # 16 tokens in full blocks, shared
    m = eng.metrics
    assert m.num_prefix_hit_tokens == 3 * full
    assert [c.num_cached_prompt_tokens for c in sorted(done, key=lambda c: c.sample_index)] == [0, full, full, full]
    # computed: the prompt once, each other sample's partial block, then each sample's decode tokens
    decode = sum(c.num_generated_tokens - 1 for c in done)
    assert m.sum_batched_tokens == len(PROMPT) + 3 * (len(PROMPT) - full) + decode
    eng.check_integrity()


def test_sample_0_is_the_n1_text_and_each_sample_has_its_derived_seed(model, tokenizer):
    group = by_sample(engine(model, tokenizer).generate([Request("row", PROMPT, SAMPLED)]))
    for i in range(4):
        alone = dataclasses.replace(SAMPLED, n=1, seed=sample_seed(SAMPLED.seed, i))
        [c] = engine(model, tokenizer).generate([Request("row", PROMPT, alone)])
        assert c.token_ids == group["row", i]
    assert sample_seed(11, 0) == 11 and len({sample_seed(11, i) for i in range(8)}) == 8


def test_greedy_samples_are_equal(model, tokenizer):
    greedy = SamplingParams(max_new_tokens=12, n=3)
    done = list(engine(model, tokenizer).generate([Request("g", PROMPT, greedy)]))
    [one] = engine(model, tokenizer).generate([Request("g", PROMPT, dataclasses.replace(greedy, n=1))])
    assert [c.token_ids for c in done] == [one.token_ids] * 3


@pytest.mark.parametrize("policy", list(Policy))
def test_samples_do_not_depend_on_the_batch_or_on_preemption(model, tokenizer, policy):
    reqs = [Request("row", PROMPT, SAMPLED), *others()]
    reference = by_sample(engine(model, tokenizer, policy).generate(reqs))
    assert len(reference) == 4 + sum(r.sampling.n for r in reqs[1:])
    alone = by_sample(engine(model, tokenizer, policy, max_num_seqs=1).generate(reqs))
    assert alone == reference
    shuffled = by_sample(engine(model, tokenizer, policy, max_num_seqs=3).generate(reqs[::-1]))
    assert shuffled == reference
    # one sample asked for alone (what a resumed job sends for a sample it still lacks)
    one = by_sample(engine(model, tokenizer, policy).generate([dataclasses.replace(reqs[0], sample_index=2)]))
    assert one == {("row", 2): reference["row", 2]}
    if policy is Policy.CONTINUOUS:  # a small cache and step budget: chunked prompts, preemptions
        tight = engine(model, tokenizer, policy, num_kv_blocks=20, budget=8)
        assert by_sample(tight.generate(reqs)) == reference
        assert tight.metrics.num_preemptions > 0


@pytest.mark.parametrize("policy", list(Policy))
def test_continued_samples_equal_uninterrupted(model, tokenizer, policy):
    reqs = [Request("row", PROMPT, SAMPLED), *others(3)]
    reference = by_sample(engine(model, tokenizer, policy).generate(reqs))
    for stop_at in (1, 4, 9):
        eng = engine(model, tokenizer, policy)
        first = by_sample(_until(eng, reqs, stop_at))
        carried = [dataclasses.replace(r, continuation=c) for r, c in eng.in_flight()]
        assert carried and all(r.sample_index is not None for r in carried if r.sampling.n > 1)
        carried_keys = {(r.request_id, r.sample_index or 0) for r in carried}
        # every sample not finished and not carried starts over, alone (sample_index)
        fresh = [dataclasses.replace(r, sample_index=i) for r in reqs for i in range(r.sampling.n)
                 if (r.request_id, i) not in first and (r.request_id, i) not in carried_keys]
        second = by_sample(engine(model, tokenizer, policy).generate(carried + fresh))
        assert not first.keys() & second.keys()
        assert {**first, **second} == reference, stop_at


def _until(eng: LLMEngine, reqs: list[Request], num_steps: int) -> list[Completion]:
    """The completions of the first `num_steps` steps of `eng.generate` (stopped between steps)."""
    steps = [0]

    class Stop(Exception):
        pass

    def between():
        steps[0] += 1
        if steps[0] == num_steps:
            raise Stop

    done = []
    try:
        for c in eng.generate(reqs, between_steps=between):
            done.append(c)
    except Stop:
        pass
    return done
