"""EngineConfig, and what it resolves to on a given model and device before the engine is built:
the attention backend, the KV block size and dtype, and how many KV blocks the cache holds."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchgen.config.choices import Policy
from batchgen.engine.attention.base import SCORE_RULE_FEATURES
from batchgen.engine.attention.registry import BACKENDS, SET_BY_FLAG, select_backend
from batchgen.engine.attention.sdpa import SdpaBackend
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.kv.cache import KVCacheSpec, plan_num_blocks, profile_activation_bytes
from batchgen.engine.kv.groups import KVGroups
from batchgen.engine.scheduler import sizing
from batchgen.errors import ConfigError, UnsupportedModelError

log = logging.getLogger(__name__)


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


def plan_kv_blocks(model: torch.nn.Module, spec: KVCacheSpec, device: torch.device, config: EngineConfig, *,
                   max_model_len: int, use_cuda_graphs: bool, kv_groups: KVGroups | None = None,
                   adapter_bytes: int = 0) -> tuple[int, int]:
    """(KV blocks to allocate, the longest sequence in tokens the budget allows).

    The blocks come from `config` (an exact count, a byte budget, or the free memory), then shrink
    to the job's need when `config.seq_token_needs` says it is less. With `kv_groups` a block holds
    one page of each of their tensors, and a sequence holds blocks in every group (kv/groups.py).
    A byte budget also holds the LoRA adapters' `adapter_bytes` (loaded before the cache is sized,
    so the free-memory budget has already lost them)."""
    block_size = spec.block_size
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        peak = 0
        if device.type == "cuda" and config.kv_cache_bytes is None:
            # auto limits are chosen after the cache is sized: profile the largest they can be
            max_seqs, max_tokens = sizing.upper_limits(device.type)
            peak = profile_activation_bytes(model, config.max_num_batched_tokens or max_tokens,
                                            config.max_num_seqs or max_seqs)
        budget = config.kv_cache_bytes
        if budget is not None and adapter_bytes:
            if adapter_bytes >= budget:
                raise ConfigError(f"KV cache: the budget of {budget} bytes is taken by the LoRA adapters' "
                                  f"{adapter_bytes} bytes; raise --kv-cache-memory or load fewer adapters")
            budget -= adapter_bytes
        try:
            num_blocks = plan_num_blocks(spec, device, budget, peak)
        except ValueError as e:
            after = f" (what the LoRA adapters' {adapter_bytes} bytes leave)" if budget != config.kv_cache_bytes else ""
            raise ConfigError(f"KV cache: {e}{after}") from None
    # the longest sequence the budget allows: prompts are cut to it, and it does not change when
    # the cache is sized to a job's need below (it is part of a job's fingerprint)
    chunk = chunk_tokens(config, device)
    if kv_groups is None:
        max_tokens_per_seq = min(max_model_len, num_blocks * block_size)
    else:
        max_tokens_per_seq = min(max_model_len, kv_groups.max_tokens(num_blocks, chunk, block_size))

    def blocks(num_tokens: int) -> int:
        if kv_groups is None:
            return -(-num_tokens // block_size)
        return kv_groups.blocks_held(num_tokens, chunk, block_size)

    if config.num_kv_blocks is None and config.seq_token_needs:
        needed = sum(blocks(min(n, max_tokens_per_seq)) for n in config.seq_token_needs)
        needed += int(use_cuda_graphs)  # the graphs' padding block
        if needed < num_blocks:
            log.debug("KV cache sized to the job's need: %d sequences, %d blocks (the budget holds %d)",
                      len(config.seq_token_needs), needed, num_blocks)
            num_blocks = needed
    return num_blocks, max_tokens_per_seq
