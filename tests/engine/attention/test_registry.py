"""The flash-attn backend's metadata (cu_seqlens, block tables, bottom-right causality).

flash-attn needs CUDA, so here a pure-torch stand-in with flash_attn_varlen_func's paged
semantics replaces it: if the runner's FlashMetadata were wrong, greedy outputs would differ
from model.generate.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.attention import flash, registry
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import Request, SamplingParams
from tests.tiny import make_tiny_model


def fake_flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale=None, causal=False, block_table=None):
    # q: [T, H, D]; k/v_cache: [num_blocks, block_size, KVH, D]; block_table: [B, max_blocks] int32
    assert causal and block_table is not None and block_table.dtype == torch.int32
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for i in range(block_table.shape[0]):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        len_k = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        assert q1 - q0 <= max_seqlen_q and len_k <= max_seqlen_k
        k = k_cache[block_table[i].long()].flatten(0, 1)[:len_k]  # [len_k, KVH, D]
        v = v_cache[block_table[i].long()].flatten(0, 1)[:len_k]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        len_q = q1 - q0
        # bottom-right causal: query j sits at absolute position len_k - len_q + j
        mask = torch.arange(len_k)[None, :] <= (len_k - len_q + torch.arange(len_q))[:, None]
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k, v, attn_mask=mask, scale=softmax_scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("max_num_batched_tokens", [4096, 24])
def test_flash_metadata_gives_generate_equal_greedy_output(tokenizer, monkeypatch, max_num_batched_tokens):
    reference = make_tiny_model("llama", seed=3)
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (int(n),), generator=gen).tolist() for n in (3, 17, 40, 9, 33, 1)]
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    monkeypatch.setattr(flash, "flash_attn_varlen_func", lambda: fake_flash_attn_varlen_func)
    engine = LLMEngine(model, tokenizer, EngineConfig(attention_backend="sdpa", block_size=8, num_kv_blocks=64,
                                                      max_num_batched_tokens=max_num_batched_tokens))
    engine.runner.backend = flash.FlashBackend()  # the CPU cannot import flash-attn; the metadata path is what we test
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]
    got = {c.request_id: c.token_ids for c in engine.generate(requests)}
    assert [got[str(i)] for i in range(len(prompts))] == expected


def test_backend_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert registry.resolve_backend("auto", cpu, None) == ("cpu", 16)  # the C decode kernel
    assert registry.resolve_backend("auto", cpu, None, torch.float16) == ("sdpa", 16)  # not in the kernel
    assert registry.resolve_backend("sdpa", cpu, 32) == ("sdpa", 32)
    assert registry.resolve_backend("torch", cpu, 32) == ("sdpa", 32)  # the old name of sdpa
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        registry.resolve_backend("cpu", cpu, 16, torch.float16)
    with pytest.raises(ValueError, match="CUDA and the flash-attn package"):
        registry.resolve_backend("flash", cpu, 256)
    with pytest.raises(ValueError, match="auto, cpu, sdpa, flash"):
        registry.resolve_backend("flashinfer", cpu, None)


def test_flash_block_size_must_be_a_multiple_of_256(monkeypatch):
    monkeypatch.setattr(flash.FlashBackend, "available", staticmethod(lambda device, dtype=None: True))
    cuda = torch.device("cuda")
    assert registry.resolve_backend("auto", cuda, None) == ("flash", 256)
    assert registry.resolve_backend("auto", cuda, 16) == ("sdpa", 16)  # auto keeps the user's block size
    with pytest.raises(ValueError, match="multiple of 256"):
        registry.resolve_backend("flash", cuda, 16)


def test_default_selection_on_cuda_is_flash_with_its_page_size(monkeypatch):
    """The job's default block size (None) lets auto pick flash-attn and its 256-token pages; the
    reason says why, and without flash-attn the torch path says that it is missing."""
    from batchgen.config.job import build_config

    config = build_config(None, inputs=["x"], output="o")
    assert config.block_size is None and config.attention_backend == "auto" and config.cuda_graphs is True
    assert build_config(None, inputs=["x"], output="o", block_size="auto").block_size is None
    cuda = torch.device("cuda")
    monkeypatch.setattr(flash.FlashBackend, "available", staticmethod(lambda device, dtype=None: True))
    choice = registry.select_backend(config.attention_backend, cuda, config.block_size, torch.bfloat16)
    assert (choice.name, choice.block_size) == ("flash", 256) and "flash-attn" in choice.reason
    assert "not a multiple of 256" in registry.select_backend("auto", cuda, 16).reason
    monkeypatch.setattr(flash.FlashBackend, "available", staticmethod(lambda device, dtype=None: False))
    choice = registry.select_backend("auto", cuda, None, torch.bfloat16)
    assert (choice.name, choice.block_size) == ("sdpa", 16) and "not installed" in choice.reason
    assert registry.select_backend("sdpa", cuda, None).reason == "set by --attention-backend"


def test_engine_logs_the_backend_and_why(tokenizer, caplog):
    with caplog.at_level("DEBUG", logger="batchgen.engine.engine"):
        LLMEngine(make_tiny_model("llama"), tokenizer, EngineConfig(attention_backend="sdpa", num_kv_blocks=8))
    assert "attention: sdpa, 16-token KV blocks (set by --attention-backend)" in caplog.text
