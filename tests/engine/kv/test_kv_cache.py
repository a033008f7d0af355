"""KV cache geometry from a model config, sizing from a byte budget, and the tensors it allocates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.kv.cache import KVCache, KVCacheSpec
from batchgen.engine.memory import CPU_KV_CAP_BYTES, plan_num_blocks
from batchgen.errors import ConfigError
from tests.tiny import make_tiny_model

CPU = torch.device("cpu")


def test_spec_from_a_gqa_config():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    spec = KVCacheSpec.from_model_config(config, torch.float32, block_size=16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size) == (3, 2, 16, 16)
    # K and V, per layer, per KV head, per channel, 4 bytes
    assert spec.bytes_per_token == 2 * 3 * 2 * 16 * 4
    assert spec.bytes_per_block == spec.bytes_per_token * 16


def test_spec_prefers_an_explicit_head_dim():
    # head_dim need not be hidden_size / num_heads (Qwen3, Gemma): the config's value wins
    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                         head_dim=32)
    spec = KVCacheSpec.from_model_config(config, torch.bfloat16, block_size=8)
    assert (spec.num_kv_heads, spec.head_dim) == (1, 32)
    assert spec.bytes_per_token == 2 * 2 * 1 * 32 * 2


def test_spec_without_kv_heads_is_multi_head():
    config = SimpleNamespace(num_hidden_layers=2, hidden_size=48, num_attention_heads=6)
    spec = KVCacheSpec.from_model_config(config, torch.float16, block_size=4)
    assert (spec.num_kv_heads, spec.head_dim) == (6, 8)


def test_spec_reads_a_nested_text_config():
    text = SimpleNamespace(num_hidden_layers=5, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=None)
    spec = KVCacheSpec.from_model_config(SimpleNamespace(text_config=text), torch.float32, block_size=16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (5, 4, 8)


def test_spec_from_the_tiny_models():
    for arch in ("llama", "qwen2", "mistral"):
        spec = KVCacheSpec.from_model_config(make_tiny_model(arch).config, torch.float32, block_size=16)
        assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)


@pytest.fixture
def spec() -> KVCacheSpec:
    return KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)


def test_plan_num_blocks_with_an_explicit_budget(spec):
    per_block = spec.bytes_per_block
    assert per_block == 8192
    assert plan_num_blocks(spec, CPU, budget_bytes=10 * per_block) == 10
    assert plan_num_blocks(spec, CPU, budget_bytes=10 * per_block + per_block - 1) == 10  # rounds down
    assert plan_num_blocks(spec, CPU, budget_bytes=per_block) == 1


@pytest.mark.parametrize("budget", [0, 1, 8191, -100])
def test_a_budget_below_one_block_is_an_error(spec, budget):
    with pytest.raises(ValueError, match="holds no block"):
        plan_num_blocks(spec, CPU, budget_bytes=budget)


def test_cpu_default_budget_is_capped(spec):
    num_blocks = plan_num_blocks(spec, CPU, budget_bytes=None)
    assert 1 <= num_blocks <= CPU_KV_CAP_BYTES // spec.bytes_per_block


def test_kv_cache_tensors(spec):
    cache = KVCache(spec, num_blocks=5, device=CPU)
    assert len(cache.layers) == 2
    for k, v in cache.layers:
        assert k.shape == v.shape == (5 * 16, 2, 16)
        assert k.dtype == torch.float32 and not k.any()
        assert k.data_ptr() != v.data_ptr()
    assert cache.num_bytes == 5 * spec.bytes_per_block
    assert sum(k.nbytes + v.nbytes for k, v in cache.layers) == cache.num_bytes


def test_engine_sizes_its_cache_from_the_budget(tokenizer):
    model = make_tiny_model("llama")
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_bytes=3 * 8192 + 5, block_size=16))
    assert engine.block_manager.num_blocks == engine.kv_cache.num_blocks == 3
    assert engine.max_tokens_per_seq == 48
    exact = LLMEngine(make_tiny_model("llama"), tokenizer, EngineConfig(num_kv_blocks=7, kv_cache_bytes=8192))
    assert exact.block_manager.num_blocks == 7  # an exact count overrides the budget


def test_engine_with_a_budget_below_one_block_fails_clearly(tokenizer):
    # a user's --kv-cache-memory too small for one block is a config error (exit 2), not a crash
    with pytest.raises(ConfigError, match="holds no block"):
        LLMEngine(make_tiny_model("llama"), tokenizer, EngineConfig(kv_cache_bytes=100))
