"""EngineConfig, and what it resolves to on a given model and device before the engine is built:
the attention backend, the KV block size and dtype (how many KV blocks the cache holds: memory.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.config.choices import Policy
from batchgen.engine.attention.registry import BACKENDS, SET_BY_FLAG, select_backend
from batchgen.engine.attention.sdpa import SdpaBackend
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.scheduler import sizing
from batchgen.engine.score_rules import SCORE_RULE_FEATURES
from batchgen.errors import ConfigError, UnsupportedModelError


@dataclass(slots=True)
class EngineConfig:
    policy: Policy = Policy.CONTINUOUS
    max_num_seqs: int | None = None  # sequences running at once (static: the batch size); None: auto (sizing.py)
    max_num_batched_tokens: int | None = None  # token budget of one step; None: auto (sizing.py)
    expected_seq_tokens: int | None = None  # auto sizing's hint: prompt + output tokens of a typical row
    block_size: int | None = None  # None: 16 for the torch backend, 256 for flash-attn
    attention_backend: str = "auto"  # config/choices.py AttentionBackendName; engine/attention/registry.py chooses
    kv_cache_bytes: int | None = None  # None: sized from free memory
    num_kv_blocks: int | None = None  # exact block count (tests); overrides kv_cache_bytes
    # prompt + max output tokens of every sequence this engine will run, when the caller knows them
    # all (a small job): the cache then holds just those, all at once, if that is less than the budget
    seq_token_needs: tuple[int, ...] | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    compile: bool = False  # torch.compile the forward (see model_runner.compile_forward)
    # CPU: run on the cores other processes leave, re-checked every few seconds (runtime/threads.py);
    # off when OMP_NUM_THREADS pins the count
    adaptive_threads: bool = True
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 (per-token, per-head scales) | fp8 (refused)
    cuda_graphs: bool = True  # CUDA + a graph-safe attention backend (flash): decode steps replay graphs
    # CPU bf16/fp16: small calls of each linear layer run on a weight reordered once (engine/model/prepack.py),
    # and MoE experts (bf16/fp32) in one grouped pass on weights reordered the same way (engine/model/experts.py);
    # ignored with compile
    prepack_weights: bool = True
    # CPU bf16: Llama-style RMSNorm and SiLU * up run as single fused C calls (engine/kernels/fused.py)
    fuse_pointwise: bool = True
    # structured output: a grammar's forced tokens run as drafts in the next chunk instead of one decode
    # step each, the output unchanged (engine/sampling/jump_forward.py)
    jump_forward: bool = True
    # LoRA adapters by name -> PEFT adapter directory (engine/lora/): a Request's `adapter` names one
    lora_adapters: dict[str, str] | None = None


def resolve_attention(config: EngineConfig, device: torch.device, model_dtype: torch.dtype,
                      score_rules: set[str] = frozenset()) -> tuple[str, int, torch.dtype, str]:
    """(backend name, KV block size in tokens, KV cache dtype, why this backend) for `config` on `device`,
    for a model whose layers need `score_rules` (ScoreRules fields: its window, softcap, sinks)."""
    try:
        choice = select_backend(config.attention_backend, device, config.block_size, model_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    backend, block_size, reason = choice.name, choice.block_size, choice.reason
    cache_dtype = kv_quant.resolve_kv_cache_dtype(config.kv_cache_dtype, model_dtype, device)
    if cache_dtype == torch.int8 and not BACKENDS[backend].reads_int8_pages:
        if reason == SET_BY_FLAG:
            raise ConfigError(f"the int8 KV cache runs on an attention backend that reads int8 pages "
                              f"({', '.join(n for n, b in BACKENDS.items() if b.reads_int8_pages)}), not {backend}")
        backend, block_size = SdpaBackend.name, config.block_size or SdpaBackend.default_block_size
        reason = f"auto: {BACKENDS[choice.name].describe} reads no int8 KV pages, so torch SDPA"
    lacking = sorted(set(score_rules) - BACKENDS[backend].score_rules)
    if lacking:
        features = ", ".join(SCORE_RULE_FEATURES[f] for f in lacking)
        if reason == SET_BY_FLAG:
            raise UnsupportedModelError(f"the {backend} attention backend has no {features}, which this model uses; "
                                        f"use --attention-backend sdpa")
        backend, block_size = SdpaBackend.name, config.block_size or SdpaBackend.default_block_size
        reason = f"auto: {BACKENDS[choice.name].describe} has no {features}, so torch SDPA"
    return backend, block_size, cache_dtype, reason


def chunk_tokens(config: EngineConfig, device: torch.device) -> int:
    """The most tokens one step computes of a sequence: the step budget, set or the largest auto allows."""
    return config.max_num_batched_tokens or sizing.upper_limits(device.type)[1]
