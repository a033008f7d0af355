"""The model families beyond plain full attention, through the engine: greedy tokens equal
`model.generate`'s, token for token in float32, with prompts and outputs longer than the sliding
window, on the C kernels and on SDPA, under chunked prefill, preemption, prefix caching and both
policies, and when rows stopped in flight continue. Tiny random-weight models built from configs;
MoE blocks run as the HF modules, their experts in the engine's grouped pass (engine/model/experts.py)
while the reference `generate` runs transformers' own."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from batchgen.config.choices import Policy
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model import experts
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import _common

WINDOW = 12  # tokens: shorter than most prompts and every output below
MAX_NEW_TOKENS = 20
MOE = dict(num_experts_per_tok=2)

# family -> (config class name, its arguments, the attention the reference runs)
FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), "sdpa"),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), "sdpa"),
    "qwen3": ("Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              "sdpa"),
    "cohere2": ("Cohere2Config", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
                "sdpa"),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, query_pre_attn_scalar=20), "eager"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=20,
                                        layer_types=["sliding_attention", "full_attention"]), "eager"),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, **MOE), "eager"),
    "mixtral": ("MixtralConfig", dict(sliding_window=WINDOW, num_local_experts=4, **MOE), "sdpa"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         **MOE), "sdpa"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, moe_intermediate_size=32, **MOE), "sdpa"),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, **MOE), "sdpa"),
}
SHIPPED = [f for f, (cls, _, _) in FAMILIES.items() if hasattr(transformers, cls)]
# full-attention and sliding layers mixed: their KV runs in layer groups (engine/kv/hybrid.py)
LOCAL_GLOBAL = {"qwen2", "qwen3", "cohere2", "gemma2", "gemma3", "gpt_oss"}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def grouped_experts_in_float32(monkeypatch):
    """The engine's grouped MoE pass runs in bf16 by default; its code is dtype-blind, so here it runs
    in float32, where greedy tokens must equal `model.generate`'s exactly."""
    monkeypatch.setattr(experts, "GROUPED_DTYPES", (torch.bfloat16, torch.float32))


def build(family: str, seed: int = 0):
    cls, kwargs, attn = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**_common(**kwargs))
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def workload() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(5, 261) for _ in range(30)]  # a cached prefix longer than the window
    prompts = [[rng.randrange(5, 261) for _ in range(n)] for n in (1, 3, WINDOW, WINDOW + 1, 40, 61)]
    # the first and the last share it: the last is admitted once the first's blocks are cached
    return [shared + [9, 10], *prompts, shared + [rng.randrange(5, 261) for _ in range(9)]]


def greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=SHIPPED)
def family(request):
    model = build(request.param)
    prompts = workload()
    return request.param, model, prompts, [greedy(model, p) for p in prompts]


CONFIGS = {
    "cpu": EngineConfig(attention_backend="cpu", block_size=8, num_kv_blocks=128, max_num_seqs=4),
    "sdpa": EngineConfig(attention_backend="sdpa", block_size=8, num_kv_blocks=128, max_num_seqs=4),
    "chunked-preempted": EngineConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=6),
    "static": EngineConfig(policy=Policy.STATIC, block_size=8, num_kv_blocks=128, max_num_seqs=8),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_tokens_equal_generate(family, config_name, tokenizer):
    name, model, prompts, refs = family
    engine = LLMEngine(copy.deepcopy(model), tokenizer, CONFIGS[config_name], eos_token_ids=[])
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
                for i, p in enumerate(prompts)]
    assert (engine.kv_groups is not None) == (name in LOCAL_GLOBAL)
    got = {c.request_id: c.token_ids for c in engine.generate(requests, between_steps=engine.check_integrity)}
    mismatched = {i: (got[str(i)], ref) for i, ref in enumerate(refs) if got[str(i)] != ref}
    assert not mismatched, f"{name}: {mismatched}"
    if experts.expert_modules(engine.model) and torch.backends.mkldnn.is_available():
        assert engine.model.config._experts_implementation == experts.EXPERTS_IMPLEMENTATION
        assert model.config._experts_implementation == "grouped_mm"  # the reference's, untouched
    summary = engine.metrics.summary()
    if config_name == "chunked-preempted" and engine.kv_window is None:  # a window's KV fits: no preemption
        assert summary["num_preemptions"] >= 1
    if config_name in ("cpu", "sdpa"):
        assert summary["num_prefix_hit_tokens"] >= 24  # the shared prefix's full blocks
    engine.check_integrity()


def test_the_window_changes_what_mistral_generates():
    """The references above are windowed: without its window the same model says other things."""
    model = build("mistral")
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = None
    prompts = workload()
    assert any(greedy(model, p) != greedy(unwindowed, p) for p in prompts[5:7])


def test_fused_cpu_paths_apply_only_where_the_math_is_llamas(caplog):
    """Gemma's (1 + weight) norm (its q/k norms too) and GELU-tanh MLP keep their own forwards, an
    MoE block keeps its own forward (its experts: engine/model/experts.py), Mistral's norm and MLP
    fuse; each decision is logged once."""
    from batchgen.engine.kernels import fused, pointwise

    if pointwise.load() is None:
        pytest.skip("no C compiler")
    with caplog.at_level("DEBUG", logger="batchgen.engine.kernels.fused"):
        assert fused.fuse_pointwise(build("gemma3")) == 0
        assert fused.fuse_pointwise(build("mistral")) > 0
        if "mixtral" in SHIPPED:
            fused.fuse_pointwise(build("mixtral"))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Gemma3RMSNorm kept its own forward" in text and "Gemma3MLP kept its own forward (activation" in text
    assert "MistralRMSNorm fused" in text and "MistralMLP fused" in text
    assert "MixtralSparseMoeBlock kept its own forward" in text or "mixtral" not in SHIPPED
    assert text.count("Gemma3RMSNorm") == 1


@pytest.mark.parametrize("stop_after_steps", [4, 15])
def test_rows_stopped_in_flight_continue_to_the_same_tokens(family, stop_after_steps, tokenizer):
    """A stop (SIGTERM's path: in-flight rows checkpointed between steps) and a rerun that
    continues each row from its tokens so far: the same tokens as one uninterrupted run, once the
    continued rows' prompt plus tokens are longer than the window."""
    import dataclasses

    from batchgen.engine.request import Continuation

    name, model, prompts, refs = family
    config = EngineConfig(block_size=4, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=24)
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
                for i, p in enumerate(prompts)]
    first = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    done, in_flight, steps = {}, {}, [0]

    class Stop(Exception):
        pass

    def between_steps():
        first.check_integrity()
        steps[0] += 1
        if steps[0] == stop_after_steps:
            in_flight.update({r.request_id: c for r, c in first.in_flight()})
            raise Stop

    with pytest.raises(Stop):
        for c in first.generate(requests, between_steps=between_steps):
            done[c.request_id] = c.token_ids
    assert in_flight
    resumed = [dataclasses.replace(r, continuation=in_flight.get(r.request_id)) for r in requests
               if r.request_id not in done]
    assert all(c is None or isinstance(c, Continuation) for c in (r.continuation for r in resumed))
    second = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    done.update({c.request_id: c.token_ids for c in second.generate(resumed, between_steps=second.check_integrity)})
    mismatched = {i: (done[str(i)], ref) for i, ref in enumerate(refs) if done[str(i)] != ref}
    assert not mismatched, f"{name}: {mismatched}"
