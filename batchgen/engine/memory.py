"""How much device memory the engine takes: the KV cache's blocks from a budget or from what is free
(MemAvailable on the CPU, what CUDA reports less a profiled step's activations), cut to a job's need;
the CPU figure is also what weight prepacking and MoE grouping size their copies from."""

from __future__ import annotations

import logging
import os

import torch

from batchgen.engine.attention.paged import ATTN_IMPLEMENTATION
from batchgen.engine.engine_config import EngineConfig, chunk_tokens
from batchgen.engine.kv.cache import KVCacheSpec
from batchgen.engine.kv.groups import KVGroups
from batchgen.engine.model.load_attention import load_attention
from batchgen.engine.scheduler import sizing
from batchgen.errors import ConfigError

log = logging.getLogger(__name__)

# the CPU default when no budget is given: a fraction of the memory the OS reports available,
# capped so a shared machine keeps room for the model, the activations and the reader
CPU_KV_FRACTION = 0.25
CPU_KV_CAP_BYTES = 2 * 2**30
CUDA_MEMORY_UTILIZATION = 0.90


def available_cpu_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_num_blocks(spec: KVCacheSpec, device: torch.device, budget_bytes: int | None,
                    activation_peak_bytes: int = 0) -> int:
    """How many blocks fit: an explicit budget, else a share of free memory on the device."""
    if budget_bytes is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            budget_bytes = int(total * CUDA_MEMORY_UTILIZATION) - used - activation_peak_bytes
        else:
            budget_bytes = min(int(available_cpu_bytes() * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no block of "
                         f"{spec.bytes_per_block} bytes")
    return int(num_blocks)


def profile_activation_bytes(model, num_tokens: int, num_seqs: int) -> int:
    """Peak activation memory of one full-budget step, so the KV cache leaves room for it.

    Runs the model once on `num_tokens` dummy tokens with plain SDPA attention (whose memory is
    close to ours) and `num_seqs` logits rows, then restores our attention function. A class that
    refuses SDPA (Gemma 2, gpt-oss) runs eager, whose score matrix over-counts: a smaller cache,
    never an out-of-memory step.
    """
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model.set_attn_implementation(load_attention(model.config) or "sdpa")
    try:
        with torch.inference_mode():
            ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
            keep = torch.arange(num_tokens - min(num_seqs, num_tokens), num_tokens, device=device)
            model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        torch.cuda.synchronize(device)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)


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
