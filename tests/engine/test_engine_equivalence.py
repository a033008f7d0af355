"""LLMEngine's greedy tokens equal Hugging Face `generate`, token for token, under every policy.

The references are `model.generate(do_sample=False)` on one prompt at a time (no padding), with
the same EOS id as the engine: HF stops at EOS and keeps it, and so does Completion.token_ids.
The engine gets a deep copy, since it switches the model to the "batchgen_paged" attention.
"""

from __future__ import annotations

import collections
import copy
import os
import random
from dataclasses import dataclass

import pytest
import torch

from batchgen.config.choices import Policy
from batchgen.engine.attention import padded_prefill, sdpa
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Completion, FinishReason, Request, SamplingParams
from tests.tiny import make_tiny_model

ARCH_SEEDS = {"llama": 0, "qwen2": 1, "mistral": 2}
NUM_PROMPTS = 28
MAX_PROMPT_LEN = 80
MAX_NEW_TOKENS = 24
SHARED_PREFIX_LEN = 40  # 5 blocks of 8, 2 blocks of 16


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@dataclass
class Case:
    model: torch.nn.Module  # keeps the "sdpa" attention; engines get deep copies
    prompts: list[list[int]]
    max_new_tokens: list[int]
    eos: int
    refs: list[list[int]]

    def requests(self) -> list[Request]:
        return [Request(str(i), p, SamplingParams(max_new_tokens=n))
                for i, (p, n) in enumerate(zip(self.prompts, self.max_new_tokens, strict=True))]

    def engine(self, tokenizer, config: EngineConfig) -> LLMEngine:
        return LLMEngine(copy.deepcopy(self.model), tokenizer, config, eos_token_ids=[self.eos])


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_workload(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, 261) for _ in range(n)]

    lengths = [1, 2, 3, MAX_PROMPT_LEN, MAX_PROMPT_LEN - 1, 16, 17, 32]
    lengths += [rng.randint(1, MAX_PROMPT_LEN) for _ in range(11)]
    prompts = [tokens(n) for n in lengths]
    shared = tokens(SHARED_PREFIX_LEN)
    prompts += [shared + tokens(rng.randint(1, 30)) for _ in range(6)]
    # an exact duplicate; the bare shared prefix (its last block is recomputed); one token past
    # the shared prefix (a cache hit that leaves a single token to compute)
    prompts += [list(prompts[-1]), list(shared), shared + tokens(1)]
    assert len(prompts) == NUM_PROMPTS and max(map(len, prompts)) <= MAX_PROMPT_LEN
    max_new = [1, MAX_NEW_TOKENS] + [rng.randint(1, MAX_NEW_TOKENS) for _ in prompts[2:]]
    return prompts, max_new


@pytest.fixture(scope="module", params=list(ARCH_SEEDS))
def case(request) -> Case:
    return build_case(request.param)


def build_case(arch: str) -> Case:
    model = make_tiny_model(arch, seed=ARCH_SEEDS[arch])
    prompts, max_new = make_workload(random.Random(ARCH_SEEDS[arch]))
    # A random model seldom emits its configured EOS, so make EOS a token it does emit: the one
    # that appears inside the most greedy continuations. Several references then stop early.
    free_runs = [hf_greedy(model, p, n, eos=2) for p, n in zip(prompts, max_new, strict=True)]
    counts = collections.Counter(t for run in free_runs for t in set(run[1:-1]))
    eos = counts.most_common(1)[0][0]
    refs = [hf_greedy(model, p, n, eos) for p, n in zip(prompts, max_new, strict=True)]
    stopped_early = sum(len(r) < n and r[-1] == eos for r, n in zip(refs, max_new, strict=True))
    assert stopped_early >= 3, "the workload must exercise EOS"
    assert sum(len(r) == n for r, n in zip(refs, max_new, strict=True)) >= 3
    return Case(model, prompts, max_new, eos, refs)


def check_completions(case: Case, completions: list[Completion], tokenizer) -> None:
    ids = [c.request_id for c in completions]
    assert sorted(ids, key=int) == [str(i) for i in range(len(case.prompts))], "lost or repeated"
    by_id = {c.request_id: c for c in completions}
    mismatched = [i for i, ref in enumerate(case.refs) if by_id[str(i)].token_ids != ref]
    assert not mismatched, {i: (by_id[str(i)].token_ids, case.refs[i]) for i in mismatched[:3]}
    for i, ref in enumerate(case.refs):
        c = by_id[str(i)]
        expected = FinishReason.STOP if ref[-1] == case.eos else FinishReason.LENGTH
        assert c.finish_reason is expected, i
        assert c.num_prompt_tokens == len(case.prompts[i])
        assert c.text == tokenizer.decode(ref, skip_special_tokens=True)


def run(case: Case, tokenizer, config: EngineConfig) -> tuple[LLMEngine, list[Completion]]:
    engine = case.engine(tokenizer, config)
    completions = list(engine.generate(case.requests()))
    check_completions(case, completions, tokenizer)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    engine.check_integrity()
    summary = engine.metrics.summary()
    assert summary["num_requests_finished"] == len(case.prompts)
    assert summary["num_generated_tokens"] == sum(map(len, case.refs))
    return engine, completions


def test_defaults(case, tokenizer):
    # default scheduling; the cache is sized from an explicit budget (the CPU default takes
    # a share of free RAM, gigabytes, which is slow to allocate in a test)
    engine, _ = run(case, tokenizer, EngineConfig(kv_cache_bytes=4 * 2**20))
    assert engine.runner.backend.name == "cpu", "the CPU default is the C decode kernel"
    assert engine.block_manager.num_blocks == 4 * 2**20 // engine.kv_cache.spec.bytes_per_block


def test_tiny_cache_preempts_and_recomputes(case, tokenizer):
    # one-token blocks; 106 of them hold the longest request (80 + 24 tokens) alone, little more
    engine, completions = run(case, tokenizer, EngineConfig(block_size=1, num_kv_blocks=106))
    assert engine.metrics.summary()["num_preemptions"] >= 3
    assert sum(c.num_preemptions for c in completions) >= 3


def test_chunked_prefill(case, tokenizer):
    budget = 32
    assert budget < max(map(len, case.prompts))
    engine, _ = run(case, tokenizer, EngineConfig(max_num_batched_tokens=budget, num_kv_blocks=256))
    assert engine.metrics.summary()["tokens_per_step_max"] == budget


def test_prefix_caching_hits_a_shared_prefix(case, tokenizer):
    engine, completions = run(case, tokenizer, EngineConfig(block_size=8, max_num_seqs=4, num_kv_blocks=256))
    assert engine.metrics.summary()["num_prefix_hit_tokens"] >= 2 * SHARED_PREFIX_LEN
    cached = [c.num_cached_prompt_tokens for c in completions]
    assert sum(1 for n in cached if n >= SHARED_PREFIX_LEN) >= 2
    assert all(n % 8 == 0 and n < len(case.prompts[int(c.request_id)])
               for c, n in zip(completions, cached, strict=True))


def test_prefix_caching_off(case, tokenizer):
    engine, completions = run(case, tokenizer, EngineConfig(block_size=8, max_num_seqs=4, num_kv_blocks=256,
                                                            enable_prefix_caching=False))
    assert engine.metrics.summary()["num_prefix_hit_tokens"] == 0
    assert all(c.num_cached_prompt_tokens == 0 for c in completions)


def test_static_policy(case, tokenizer):
    engine, _ = run(case, tokenizer, EngineConfig(policy=Policy.STATIC, max_num_seqs=8, num_kv_blocks=256))
    assert engine.metrics.summary()["num_preemptions"] == 0
    assert engine.metrics.summary()["running_max"] <= 8


def test_static_policy_tight_cache(case, tokenizer):
    engine, _ = run(case, tokenizer, EngineConfig(policy=Policy.STATIC, max_num_seqs=8, block_size=8,
                                                  num_kv_blocks=20, max_num_batched_tokens=48))
    assert engine.metrics.summary()["num_preemptions"] == 0


@pytest.mark.parametrize("block_size", [16, 4])
def test_sdpa_attention_backend(case, tokenizer, block_size, monkeypatch):
    # the CPU default decodes through the C kernel; the pure-torch path (grouped, gathered SDPA) is
    # the fallback without a compiler and the path on CUDA without flash-attn: it must agree too,
    # with its padded calls for fresh prompts and for chunks / prefix-cache hits with a past
    padded = collections.Counter()
    build = padded_prefill.build_padded_batches

    def counting(*args, **kwargs):
        fresh, with_past = build(*args, **kwargs)
        padded.update(fresh=fresh is not None, with_past=with_past is not None)
        return fresh, with_past

    monkeypatch.setattr(sdpa, "build_padded_batches", counting)
    engine, _ = run(case, tokenizer, EngineConfig(attention_backend="sdpa", block_size=block_size,
                                                  num_kv_blocks=3000 // block_size, max_num_batched_tokens=48))
    assert engine.runner.backend.name == "sdpa"
    assert padded["fresh"] and padded["with_past"], padded


def test_everything_tight_with_integrity_checks_every_step(case, tokenizer):
    # small blocks, small cache, small budget, prefix caching: preemption, chunking and cache
    # hits all at once; the engine is driven step by step and checked after each step
    config = EngineConfig(block_size=4, num_kv_blocks=30, max_num_batched_tokens=24, max_num_seqs=6)
    engine = case.engine(tokenizer, config)
    for request in case.requests():
        engine.add_request(request)
    completions: list[Completion] = []
    while engine.has_unfinished():
        completions.extend(engine.step())
        engine.check_integrity()
        assert len(engine.scheduler.running) <= engine.scheduler.max_num_seqs
    check_completions(case, completions, tokenizer)
    summary = engine.metrics.summary()
    assert summary["num_preemptions"] >= 1 and summary["num_prefix_hit_tokens"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- sequences that do not fit the cache ---------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama", seed=0)


def test_request_that_outgrows_the_cache_ends_at_length(llama, tokenizer):
    # 4 blocks x 4 tokens: a 10-token prompt gets 16 computed tokens, so 7 generated ones
    prompt = list(range(40, 50))
    ref = hf_greedy(llama, prompt, 7, eos=2)
    engine = LLMEngine(copy.deepcopy(llama), tokenizer, EngineConfig(num_kv_blocks=4, block_size=4),
                       eos_token_ids=[2])
    [completion] = engine.generate([Request("big", prompt, SamplingParams(max_new_tokens=20))])
    assert completion.token_ids == ref
    assert completion.finish_reason is (FinishReason.STOP if ref[-1] == 2 else FinishReason.LENGTH)
    assert engine.block_manager.num_free_blocks == 4
    engine.check_integrity()


def test_prompt_that_needs_every_block_still_runs(llama, tokenizer):
    # 14 tokens need all 4 blocks of 4: nothing else runs, so no watermark may hold it back
    prompt = list(range(60, 74))
    ref = hf_greedy(llama, prompt, 2, eos=2)
    engine = LLMEngine(copy.deepcopy(llama), tokenizer, EngineConfig(num_kv_blocks=4, block_size=4),
                       eos_token_ids=[2])
    [completion] = engine.generate([Request("full", prompt, SamplingParams(max_new_tokens=2))])
    assert completion.token_ids == ref


def test_prompt_too_long_for_the_cache_is_rejected(llama, tokenizer):
    from batchgen.engine.admission import RequestRejected

    engine = LLMEngine(copy.deepcopy(llama), tokenizer, EngineConfig(num_kv_blocks=4, block_size=4))
    with pytest.raises(RequestRejected):
        engine.add_request(Request("long", list(range(16)), SamplingParams(max_new_tokens=1)))
    with pytest.raises(RequestRejected):
        engine.add_request(Request("empty", [], SamplingParams(max_new_tokens=1)))


# ---- seeded sampling -------------------------------------------------------------------------------

def sampled(seed: int | None, max_new_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.9, top_k=20, seed=seed,
                          ignore_eos=True)


def batch_mates(rng: random.Random, n: int) -> list[Request]:
    """Greedy, seeded and unseeded rows that run to their length (EOS ignored), so the schedule, and
    with it the preemptions the test relies on, does not depend on the kernels' rounding."""
    mates = []
    for i in range(n):
        prompt = [rng.randrange(5, 261) for _ in range(rng.randint(1, 60))]
        kind = i % 3
        params = (SamplingParams(max_new_tokens=rng.randint(1, 30), ignore_eos=True) if kind == 0
                  else sampled(seed=rng.randrange(2**31), max_new_tokens=rng.randint(1, 30)) if kind == 1
                  else SamplingParams(max_new_tokens=rng.randint(1, 30), temperature=1.3, ignore_eos=True))  # unseeded
        mates.append(Request(f"mate{i}", prompt, params))
    return mates


def test_seeded_sampling_does_not_depend_on_the_batch(llama, tokenizer):
    prompt = list(range(100, 130))

    def generate(config: EngineConfig, requests: list[Request]) -> dict[str, Completion]:
        engine = LLMEngine(copy.deepcopy(llama), tokenizer, config, eos_token_ids=[2])
        return {c.request_id: c for c in engine.generate(requests)}

    target = Request("target", prompt, sampled(seed=1234))
    alone = generate(EngineConfig(num_kv_blocks=64), [target])["target"].token_ids
    assert len(alone) == 24
    assert alone != hf_greedy(llama, prompt, 24, eos=2), "sampling should not be greedy here"

    mates = batch_mates(random.Random(7), 32)
    batch = mates[:17] + [target] + mates[17:]
    in_batch = generate(EngineConfig(num_kv_blocks=256), batch)
    assert in_batch["target"].token_ids == alone
    # also when it is preempted and recomputed, in chunks: its random stream is not replayed
    tight = generate(EngineConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32), batch)
    assert tight["target"].num_preemptions >= 1
    assert tight["target"].token_ids == alone

    other_seed = generate(EngineConfig(num_kv_blocks=64), [Request("target", prompt, sampled(seed=1235))])
    assert other_seed["target"].token_ids != alone
    again = generate(EngineConfig(num_kv_blocks=64), [target])
    assert again["target"].token_ids == alone


def test_compiled_forward_matches_generate(tokenizer, tmp_path, monkeypatch):
    # torch.compile of the whole HF forward, attention as the opaque batchgen::paged_attention op:
    # same tokens as the eager reference, across prefill chunks, decode and a mixed step
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # torch picks its /tmp default and writes it into the environment, as an import can
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())
    case = build_case("llama")
    engine, _ = run(case, tokenizer, EngineConfig(num_kv_blocks=512, block_size=8, max_num_batched_tokens=64,
                                                  compile=True))
    assert engine.config.compile
    # the compiled kernels went to batchgen's cache, where a later run finds them
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert any((tmp_path / "inductor").iterdir())


def test_auto_limits_follow_the_cache_and_the_workload(case, tokenizer):
    # 64 blocks of 8 = 512 tokens; rows of ~100 tokens: 5 fit, so 5 run at once
    engine, _ = run(case, tokenizer, EngineConfig(num_kv_blocks=64, block_size=8, expected_seq_tokens=100))
    assert engine.scheduler.max_num_seqs == 5
    assert engine.scheduler.max_num_batched_tokens >= 5
