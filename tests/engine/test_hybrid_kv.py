"""KV memory that follows the window on a local/global model (Gemma 3's five sliding layers to one
full one): the sliding layers' blocks leave the pool's hold once out of their window, so the same
cache bytes run several times the concurrent long sequences of keeping every layer's KV, with the
same tokens as `model.generate`."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from batchgen.config.choices import Policy
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model import families
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.sampling.sampler import sample_seed
from tests.engine.test_window_kv import MAX_NEW_TOKENS, greedy  # the same generate reference
from tests.tiny import _common

WINDOW = 12
PROMPT_LEN = 8 * WINDOW  # prompts of 8x the window
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def gemma3():
    torch.manual_seed(5)
    config = Gemma3TextConfig(**_common(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=20,
                                        num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES))
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def run(model, tokenizer, prompts, config: EngineConfig):
    """(tokens per request, the sequences running after each step, the engine), integrity checked every step"""
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    running: list[int] = []

    def between_steps():
        running.append(len(engine.scheduler.running))
        engine.check_integrity()

    requests = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
                for i, p in enumerate(prompts)]
    got = {c.request_id: c.token_ids for c in engine.generate(requests, between_steps=between_steps)}
    return [got[str(i)] for i in range(len(prompts))], running, engine


@pytest.fixture(scope="module")
def model_and_prompts():
    model = gemma3()
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 261) for _ in range(PROMPT_LEN)] for _ in range(24)]
    return model, prompts, [greedy(model, p) for p in prompts]


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_the_same_cache_bytes_run_three_times_the_concurrent_sequences(backend, model_and_prompts, tokenizer,
                                                                       monkeypatch):
    # measured here: 9 sequences at once against 3 (the goal: >= 3x at prompts >= 4x the window)
    model, prompts, refs = model_and_prompts
    all_layers_bytes = 72 * 4 * 2 * len(LAYER_TYPES) * 2 * 16 * 4  # 72 blocks of 4 tokens, 6 layers, K+V f32
    config = EngineConfig(attention_backend=backend, block_size=4, kv_cache_bytes=all_layers_bytes, max_num_seqs=24,
                          max_num_batched_tokens=48, enable_prefix_caching=False)
    got_hybrid, running_hybrid, engine = run(model, tokenizer, prompts, config)
    assert engine.kv_groups is not None and engine.kv_groups.group_windows == (None,) + (WINDOW,) * 5
    assert engine.kv_cache.num_bytes == all_layers_bytes
    monkeypatch.setattr(families, "kv_groups", lambda model: None)  # every layer keeps all its KV
    got_full, running_full, full = run(model, tokenizer, prompts, config)
    assert full.kv_groups is None and full.kv_cache.num_bytes == all_layers_bytes
    assert got_hybrid == refs and got_full == refs
    peak_hybrid, peak_full = max(running_hybrid), max(running_full)
    mean = [sum(r) / len(r) for r in (running_hybrid, running_full)]
    print(f"{backend}: at most {peak_hybrid} sequences at once against {peak_full}; {mean[0]:.2f} against "
          f"{mean[1]:.2f} on average over {len(running_hybrid)} and {len(running_full)} steps")
    assert peak_hybrid >= 3 * peak_full, (peak_hybrid, peak_full)


@pytest.mark.parametrize("policy", [Policy.STATIC, Policy.CONTINUOUS])
def test_shared_prefixes_longer_than_the_window_under_a_tight_cache(policy, tokenizer):
    """Prefix hits whose early sliding blocks were dropped (and some evicted), preemption or static
    promises in a cache that holds few sequences: the tokens stay generate's, the pool whole."""
    model = gemma3()
    rng = random.Random(4)
    shared = [rng.randrange(5, 261) for _ in range(3 * WINDOW)]
    prompts = [shared + [rng.randrange(5, 261) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    prompts += [[rng.randrange(5, 261) for _ in range(rng.randint(1, 70))] for _ in range(5)]
    config = EngineConfig(policy=policy, block_size=4, num_kv_blocks=120, max_num_seqs=6, max_num_batched_tokens=20)
    got, _, engine = run(model, tokenizer, prompts, config)
    assert got == [greedy(model, p) for p in prompts]
    summary = engine.metrics.summary()
    assert summary["num_prefix_hit_tokens"] > 0
    if policy is Policy.CONTINUOUS:
        assert summary["num_preemptions"] >= 1
    else:
        assert summary["num_preemptions"] == 0  # the sliding groups' blocks were promised
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.block_manager.promises


def test_a_sliding_layer_attending_past_its_groups_window_is_an_error_not_a_wrong_answer(tokenizer):
    engine = LLMEngine(gemma3(), tokenizer, EngineConfig(block_size=4, num_kv_blocks=64), eos_token_ids=[])
    assert engine.kv_groups is not None
    engine.model.model.layers[2].self_attn.sliding_window = WINDOW + 4  # further back than its group keeps
    with pytest.raises(RuntimeError, match="keeps only the last 12"):
        list(engine.generate([Request("r", list(range(5, 40)), SamplingParams(max_new_tokens=2))]))


def test_layers_of_a_group_position_share_one_tensor_pair():
    from batchgen.engine.kv.cache import KVCache, KVCacheSpec
    from batchgen.engine.kv.groups import plan_groups

    groups = plan_groups([8, None, 8, None])
    spec = KVCacheSpec(groups.num_tensors, 2, 16, torch.float32, 4)
    cache = KVCache(spec, 10, torch.device("cpu"), groups.layer_tensor)
    assert len(cache.layers) == 4 and cache.layers[0] is cache.layers[1] and cache.layers[2] is cache.layers[3]
    assert cache.layers[0] is not cache.layers[2]
    assert cache.num_bytes == 10 * 4 * 2 * 2 * 2 * 16 * 4  # 2 tensor pairs, not 4


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_int8_pages_in_layer_groups_give_the_tokens_of_int8_pages_kept_whole(backend, tokenizer, monkeypatch):
    """int8 pages quantize each token's K/V on its own, so where a layer group's blocks live cannot
    change a token: the groups' run equals the all-KV run of the same int8 cache."""
    model = gemma3()
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 261) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    config = EngineConfig(attention_backend=backend, block_size=4, num_kv_blocks=300, max_num_seqs=4,
                          max_num_batched_tokens=32, kv_cache_dtype="int8")
    got_groups, _, engine = run(model, tokenizer, prompts, config)
    assert engine.kv_groups is not None and engine.kv_cache.scales[0] is engine.kv_cache.scales[1]
    monkeypatch.setattr(families, "kv_groups", lambda model: None)
    got_whole, _, whole = run(model, tokenizer, prompts, config)
    assert whole.kv_groups is None
    assert got_groups == got_whole


def test_static_rows_past_their_predicted_length_are_parked_and_finish_with_generates_tokens(tokenizer):
    import dataclasses

    model = gemma3()
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 261) for _ in range(rng.randint(30, 60))] for _ in range(6)]
    config = EngineConfig(policy=Policy.STATIC, block_size=4, num_kv_blocks=200, max_num_seqs=4,
                          max_num_batched_tokens=24)
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    requests = [dataclasses.replace(Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)),
                                    predicted_num_output_tokens=10 if i % 2 else None) for i, p in enumerate(prompts)]
    got = {c.request_id: c.token_ids for c in engine.generate(requests, between_steps=engine.check_integrity)}
    assert [got[str(i)] for i in range(len(prompts))] == [greedy(model, p) for p in prompts]
    summary = engine.metrics.summary()
    assert summary["num_overruns"] >= 1 and summary["num_preemptions"] == 0


def test_the_longest_request_counts_window_bounded_blocks_in_the_sliding_groups(tokenizer):
    from batchgen.engine.admission import RequestRejected

    model = gemma3()
    config = EngineConfig(block_size=4, num_kv_blocks=60, max_num_seqs=2, max_num_batched_tokens=16)
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    # 1 full group, 5 sliding ones of (12 + 16 - 1) // 4 + 2 = 8 blocks: 60 blocks hold 80 tokens, not 240
    assert engine.max_tokens_per_seq == engine.kv_groups.max_tokens(60, 16, 4) == 80
    with pytest.raises(RequestRejected):
        engine.add_request(Request("long", list(range(5, 85)), SamplingParams(max_new_tokens=4)))
    # a prompt under it runs; decoding holds fewer sliding blocks than a prefill chunk, so it grows past 80
    prompt = list(range(5, 75))
    request = Request("r", prompt, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    done = list(engine.generate([request], between_steps=engine.check_integrity))
    assert done[0].token_ids == greedy(model, prompt)


def test_a_small_jobs_cache_is_sized_by_the_blocks_its_rows_hold_in_every_group(tokenizer):
    from batchgen.engine.kv.groups import window_blocks

    config = EngineConfig(block_size=4, kv_cache_bytes=1 << 24, max_num_batched_tokens=16,
                          seq_token_needs=(100, 8))
    engine = LLMEngine(gemma3(), tokenizer, config, eos_token_ids=[])
    assert engine.kv_cache.num_blocks == (25 + 5 * window_blocks(WINDOW, 16, 4)) + 6 * 2


@pytest.mark.parametrize("policy", list(Policy))
def test_samples_of_a_request_on_layer_groups_equal_each_sample_run_alone(policy, tokenizer):
    # the pool of several groups does not fork a leader's blocks: each sample is computed (or found in
    # the prefix cache) on its own, and draws what it draws alone with its derived seed
    model = gemma3()
    prompt = [7 + (i * 37) % 250 for i in range(40)]  # longer than the window
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=11, n=3, ignore_eos=True)
    config = EngineConfig(policy=policy, block_size=4, num_kv_blocks=96, adaptive_threads=False)
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    assert engine.block_manager.forks_samples is False
    got = {c.sample_index: c.token_ids
           for c in engine.generate([Request("row", prompt, sampled)], between_steps=engine.check_integrity)}
    assert sorted(got) == [0, 1, 2] and len({tuple(t) for t in got.values()}) == 3
    for i in range(3):
        alone = dataclasses.replace(sampled, n=1, seed=sample_seed(sampled.seed, i))
        solo = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
        [c] = solo.generate([Request("row", prompt, alone)])
        assert c.token_ids == got[i]
