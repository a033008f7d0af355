"""The "batchgen_paged" attention function: its contract, its guards, and unsupported models."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from batchgen.engine.attention import paged as attention
from batchgen.engine.attention import registry
from batchgen.engine.attention.paged import ATTN_IMPLEMENTATION, paged_attention_forward
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.forward_context import current_metadata, forward_context
from batchgen.engine.kv.block_manager import BlockManager
from batchgen.engine.kv.cache import KVCache, KVCacheSpec
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.request import FinishReason, Request, SamplingParams
from batchgen.engine.scheduler.scheduler import Scheduler
from batchgen.engine.sequence import Sequence
from batchgen.errors import UnsupportedModelError
from tests.tiny import VOCAB_SIZE, make_tiny_model

TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_every_test(one_thread):
    """Every test here runs on one intra-op thread (conftest's one_thread)."""


def build(config, attn_implementation: str = "sdpa"):
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                            dtype=torch.float32).eval()


# ---- outside the engine ----------------------------------------------------------------------------

def test_paged_attention_outside_the_engine_raises_a_clear_error():
    attention.register()
    model = make_tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = model(input_ids=ids).logits
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="only inside batchgen's engine.*set_attn_implementation"):
        model(input_ids=ids)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(model(input_ids=ids).logits, expected)


def test_engine_switches_the_model_it_is_given(tokenizer):
    model = make_tiny_model("llama")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=8))
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    with pytest.raises(RuntimeError, match="only inside batchgen's engine"):
        engine.model(input_ids=torch.tensor([[5, 6]]))


def test_forward_context_does_not_nest_and_always_clears():
    meta = SimpleNamespace()  # the context only carries it
    with forward_context(meta):
        assert current_metadata() is meta
        with pytest.raises(AssertionError):
            with forward_context(meta):
                pass
    with pytest.raises(ValueError):
        with forward_context(meta):
            raise ValueError("boom")
    assert current_metadata() is None


# ---- the packed computation against plain attention -------------------------------------------------

class StubModel(torch.nn.Module):
    """Stands in for an HF model: q/k/v looked up from fixed tables by (token, position), one
    paged attention call, logits from its output. Records each step's attention output."""

    def __init__(self, vocab: int = 40, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                 max_pos: int = 128):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.config = SimpleNamespace(model_type="stub")
        self.layer_idx = 0
        self.scale = head_dim ** -0.5
        self.q = torch.randn(vocab, heads, head_dim, generator=g)
        self.k = torch.randn(vocab, kv_heads, head_dim, generator=g)
        self.v = torch.randn(vocab, kv_heads, head_dim, generator=g)
        self.q_pos = torch.randn(max_pos, heads, head_dim, generator=g)
        self.k_pos = torch.randn(max_pos, kv_heads, head_dim, generator=g)
        self.lm_head = torch.randn(heads * head_dim, vocab, generator=g)
        self.outputs: list[torch.Tensor] = []

    def qkv(self, ids: torch.Tensor, pos: torch.Tensor):
        return self.q[ids] + self.q_pos[pos], self.k[ids] + self.k_pos[pos], self.v[ids]

    def forward(self, input_ids, position_ids, use_cache, logits_to_keep):
        q, k, v = self.qkv(input_ids[0], position_ids[0])  # [T, heads or kv_heads, head_dim]
        out, _ = paged_attention_forward(self, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], None, scaling=self.scale)
        out = out[0]  # [T, heads, head_dim]
        self.outputs.append(out.clone())
        return SimpleNamespace(logits=(out.flatten(1) @ self.lm_head)[logits_to_keep][None])

    def reference(self, token_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Plain causal attention of positions [start, end) over tokens [0, end)."""
        ids, pos = torch.tensor(token_ids[:end]), torch.arange(end)
        q, k, v = self.qkv(ids, pos)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("nhd,chd->hnc", q[start:end], k) * self.scale
        visible = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
@pytest.mark.parametrize(("block_size", "budget", "prefix_caching"), [(4, 16, True), (1, 7, False),
                                                                        (8, 64, True)])
def test_packed_steps_match_plain_attention(block_size, budget, prefix_caching, backend):
    """Prompts, prefill chunks over a cached past, prefix-cache hits and decodes of different
    context lengths packed into each step give, token for token, plain causal attention."""
    stub = StubModel()
    bm = BlockManager(200 // block_size, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=5, max_num_batched_tokens=budget, max_model_len=128)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=block_size)
    runner = ModelRunner(stub, KVCache(spec, bm.num_blocks, torch.device("cpu")), torch.device("cpu"),
                         registry.make_backend(backend))
    rng = random.Random(block_size)
    shared = [rng.randrange(40) for _ in range(13)]
    for i in range(10):
        prompt = [rng.randrange(40) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            prompt = shared + prompt[:5]
        request = Request(str(i), prompt, SamplingParams(max_new_tokens=rng.randint(1, 12)))
        sched.add(Sequence.from_request(i, request))

    num_steps = num_decodes = num_chunks_with_past = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.out_of_memory
        layout = [(s.seq, s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
        sampled = runner.run(out)
        got = stub.outputs[-1]
        t = 0
        for seq, start, n in layout:  # packed back to back, in scheduled order
            expected = stub.reference(seq.token_ids, start, start + n)
            torch.testing.assert_close(got[t:t + n], expected, atol=1e-5, rtol=1e-5)
            num_decodes += n == 1 and start > 0
            num_chunks_with_past += n > 1 and start > 0
            t += n
        assert t == got.shape[0]
        for seq in sched.update(out, sampled):
            if seq.num_generated_tokens >= seq.request.sampling.max_new_tokens:
                sched.finish(seq, FinishReason.LENGTH)
        num_steps += 1
        assert num_steps < 500
    assert num_decodes > 10 and num_chunks_with_past > 0
    if prefix_caching:
        assert bm.num_prefix_hit_tokens > 0


# ---- models the engine refuses --------------------------------------------------------------------------

def assert_rejected(model, tokenizer, match: str):
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=match):
        LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=8))
    assert model.config._attn_implementation == before, "a rejected model must be left as it was"


def test_a_layer_kind_the_engine_lacks_is_rejected(tokenizer):
    config = Qwen2Config(**TINY, layer_types=["full_attention", "linear_attention"])
    assert_rejected(build(config), tokenizer, "linear_attention")


def test_bidirectional_attention_is_rejected(tokenizer):
    config = Gemma2Config(**TINY, head_dim=16)
    config.use_bidirectional_attention = True
    assert_rejected(build(config, "eager"), tokenizer, "bidirectional")


@pytest.mark.parametrize("config", [
    MistralConfig(**TINY, sliding_window=16),
    Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=2),  # every layer full
    Gemma2Config(**TINY, head_dim=16, attn_logit_softcapping=50.0),
], ids=["mistral-window", "qwen2-window-layers", "qwen2-flag-only", "gemma2"])
def test_windowed_and_softcapped_models_are_accepted(config, tokenizer):
    LLMEngine(build(config, "eager"), tokenizer, EngineConfig(num_kv_blocks=8))


def test_model_without_the_attention_interface_is_rejected(tokenizer):
    class Legacy(torch.nn.Module):
        config = LlamaConfig(**TINY)

    with pytest.raises(UnsupportedModelError, match="attention interface"):
        LLMEngine(Legacy(), tokenizer, EngineConfig(num_kv_blocks=8))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_supported_tiny_models_are_accepted(arch, tokenizer):
    LLMEngine(make_tiny_model(arch), tokenizer, EngineConfig(num_kv_blocks=8))


def test_the_runner_replaces_its_cache_and_drops_graphs_of_the_old_one():
    """The runner owns its KV cache: a new one comes with the graphs that held the old one's addresses gone."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
    runner = ModelRunner(StubModel(), None, torch.device("cpu"), registry.make_backend("sdpa"), kv_window=16)
    first = runner.allocate_cache(spec, 10)
    runner.graphs = SimpleNamespace(kv_cache=first)  # stands for graphs captured over the first cache
    second = runner.allocate_cache(spec, 7)
    assert runner.kv_cache is second and second.num_blocks == 7 and runner.graphs is None
    assert runner.kv_window == 16 and runner.kv_groups is None
