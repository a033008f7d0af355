"""Paged attention for unmodified Hugging Face models, registered as "batchgen_paged".

The model runner packs every sequence of a step into one row (`input_ids [1, T]`) and sets an
`AttentionMetadata` in a forward context; transformers then calls `paged_attention_forward` once
per layer with that layer's q/k/v (RoPE already applied). With no mask function registered for
our name, transformers passes `attention_mask=None`: causality and the isolation between the
sequences packed into one row are enforced here.

Per layer the function
  1. writes the step's new K/V into the paged cache at `slot_mapping`;
  2. attends: sequences with one new token (decode, or the last token of a chunk) in one batched
     SDPA over their gathered blocks, padded to the group's longest context and masked;
     sequences with several new tokens (prefill chunks) one SDPA each, causal, with the query
     offset by the tokens already cached.

Backends: "cpu" (the CPU default) runs decode through a C kernel that reads K/V in place from
the pages (engine/native.py); "torch" (SDPA over gathered blocks) runs everywhere, CUDA included,
and is the fallback where the kernel cannot be built; "flash" is flash-attn's paged varlen on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.engine import kv_quant, native
from batchgen.errors import UnsupportedModelError

ATTN_IMPLEMENTATION = "batchgen_paged"


@dataclass(slots=True)
class DecodeGroup:
    """Sequences that each have exactly one query token this step."""

    token_idx: torch.Tensor  # [B] positions of their query tokens in the packed row
    block_ids: torch.Tensor  # [B * max_num_blocks] each one's block table, padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_num_blocks * block_size] True where the key is real
    max_num_blocks: int


@dataclass(slots=True)
class NativeDecode:
    """Every decode sequence of the step for the CPU kernel, which reads the pages in place."""

    token_idx: torch.Tensor  # [B] positions of their query tokens in the packed row
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with block 0 (never read)
    context_lens: torch.Tensor  # [B] int32


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with several query tokens this step (a prompt or a chunk of one)."""

    start: int  # its first query token in the packed row
    end: int
    context_len: int  # cached past + new tokens
    # its block table covering [0, context_len), or None when it has no cached past, so its
    # new K/V are the whole context and need no gather
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None  # [num_new, context_len] causal with offset; None = plain causal


@dataclass(slots=True)
class FlashMetadata:
    """flash-attn's paged varlen call: every scheduled sequence in one kernel launch."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32, query tokens per sequence, cumulated
    cu_seqlens_k: torch.Tensor  # [B + 1] int32, context (cached + new) per sequence, cumulated
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [B, max_num_blocks] int32


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_slots, kv_heads, head_dim]
    block_size: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    native_decode: NativeDecode | None = None  # set: decode through the CPU kernel, not decode_groups
    prefills: list[PrefillSeq] = field(default_factory=list)
    flash: FlashMetadata | None = None  # set: use flash-attn instead of the torch SDPA path
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # int8 pages: per layer k, v [num_slots, kv_heads]


_forward_metadata: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make `metadata` visible to the attention function for one forward pass."""
    global _forward_metadata
    assert _forward_metadata is None, "forward contexts do not nest"
    _forward_metadata = metadata
    try:
        yield
    finally:
        _forward_metadata = None


class UnsupportedAttentionFeature(UnsupportedModelError, RuntimeError):
    """The model asked for an attention feature this engine does not implement."""


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The function transformers calls per layer; traceable, so torch.compile keeps one graph.

    Everything that depends on the step (the metadata, the cache tensors) is read inside the
    opaque `batchgen::paged_attention` op at run time, never here, so a compiled forward neither
    breaks its graph at every layer nor guards on per-step Python objects.
    """
    # query: [1, num_heads, T, head_dim]; key/value: [1, num_kv_heads, T, head_dim]
    _reject_unsupported(module, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.batchgen.paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                             value[0].transpose(0, 1), module.layer_idx, float(scale))
    return out.unsqueeze(0), None  # [1, T, num_heads, head_dim]


@torch.library.custom_op("batchgen::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                        scale: float) -> torch.Tensor:
    # q: [T, num_heads, head_dim]; k/v: [T, num_kv_heads, head_dim]. Writes this layer's new K/V
    # into the paged cache (a side effect on tensors the compiler never sees) and attends.
    meta = _forward_metadata
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention runs only inside batchgen's engine; "
                           "call model.set_attn_implementation('sdpa') to use the model directly")
    k_cache, v_cache = meta.kv_caches[layer_idx]
    k_scale = v_scale = None
    if meta.kv_scales is None:
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    else:  # int8 pages: quantized on write; the new tokens are attended as the cache holds them
        k_scale, v_scale = meta.kv_scales[layer_idx]
        k, v = kv_quant.write(k_cache, v_cache, k_scale, v_scale, meta.slot_mapping, k, v)

    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    bs = meta.block_size
    # the cache seen as pages: [num_blocks, block_size, kv_heads, head_dim] (flash-attn's layout)
    k_blocks = k_cache.view(-1, bs, num_kv_heads, head_dim)
    v_blocks = v_cache.view(-1, bs, num_kv_heads, head_dim)
    if meta.flash is not None:
        return _flash_forward(q, k_blocks, v_blocks, meta.flash, scale)
    # NOTE: torch.empty_like(q) would copy q's transposed strides; the output must be dense
    out = q.new_empty(q.shape)  # [T, num_heads, head_dim]
    group_size = num_heads // num_kv_heads
    if meta.native_decode is not None:
        nd = meta.native_decode
        od = native.load()(q.index_select(0, nd.token_idx), k_cache, v_cache, nd.block_tables, nd.context_lens,
                           bs, scale, None if k_scale is None else (k_scale, v_scale))
        out.index_copy_(0, nd.token_idx, od)
    for group in meta.decode_groups:
        batch = group.token_idx.shape[0]
        max_seqlen_k = group.max_num_blocks * bs
        shape = (batch, max_seqlen_k, num_kv_heads, head_dim)
        kd = kv_quant.gather(k_blocks, k_scale, group.block_ids, q.dtype).view(shape).transpose(1, 2)
        vd = kv_quant.gather(v_blocks, v_scale, group.block_ids, q.dtype).view(shape).transpose(1, 2)
        # One query token per sequence: the query heads sharing a KV head become that head's
        # "query positions" ([B, kv_heads, group_size, head_dim]), so GQA needs no repeated K/V.
        # Head h reads KV head h // group_size, as transformers' repeat_kv lays them out.
        qd = q.index_select(0, group.token_idx).view(batch, num_kv_heads, group_size, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale)
        out.index_copy_(0, group.token_idx, od.reshape(batch, num_heads, head_dim))
    for p in meta.prefills:
        qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
        if p.block_ids is None:
            kp = k[p.start:p.end]
            vp = v[p.start:p.end]
        else:  # [context_len, kv_heads, head_dim]
            kp = kv_quant.gather(k_blocks, k_scale, p.block_ids, q.dtype).flatten(0, 1)[: p.context_len]
            vp = kv_quant.gather(v_blocks, v_scale, p.block_ids, q.dtype).flatten(0, 1)[: p.context_len]
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context_len, head_dim]
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None,
                                            scale=scale, enable_gqa=True)
        out[p.start:p.end] = op[0].transpose(0, 1)
    return out


@_paged_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _flash_forward(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, flash: FlashMetadata,
                   scaling: float) -> torch.Tensor:
    # q: [T, num_heads, head_dim]; k/v_blocks: [num_blocks, block_size, kv_heads, head_dim]
    # flash-attn aligns causal masks bottom-right when seqlen_q < seqlen_k (>= 2.1), which is
    # exactly "query i of a chunk sees the cached past plus new tokens up to itself".
    return flash_attn_varlen_func()(
        q.contiguous(), k_blocks, v_blocks, flash.cu_seqlens_q, flash.cu_seqlens_k, flash.max_seqlen_q,
        flash.max_seqlen_k, softmax_scale=scaling, causal=True, block_table=flash.block_table)


def flash_attn_varlen_func():
    """flash-attn's varlen function, imported on first use (tests may replace this hook)."""
    from flash_attn import flash_attn_varlen_func as fn

    return fn


FLASH_BLOCK_SIZE_MULTIPLE = 256  # flash-attn 2 paged KV needs pages of a multiple of 256 tokens


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and native.PagedDecodeKernel.supports(dtype, dtype) and native.load() is not None


def resolve_backend(backend: str, device: torch.device, block_size: int | None,
                    dtype: torch.dtype = torch.float32) -> tuple[str, int]:
    """Pick the attention backend and the block size it needs: ("torch"|"cpu"|"flash", block_size)."""
    if backend not in ("auto", "torch", "cpu", "flash"):
        raise ValueError(f"attention backend must be auto, torch, cpu or flash; got {backend!r}")
    if backend == "auto":
        use_flash = flash_available(device) and (block_size is None or block_size % FLASH_BLOCK_SIZE_MULTIPLE == 0)
        backend = "flash" if use_flash else "cpu" if cpu_kernel_available(device, dtype) else "torch"
    if backend == "cpu" and not cpu_kernel_available(device, dtype):
        raise ValueError(f"the cpu attention backend needs a CPU model in float32 or bfloat16 (got {device.type}, "
                         f"{dtype}) and a C compiler to build its kernel")
    if backend == "flash":
        if not flash_available(device):
            raise ValueError("the flash attention backend needs CUDA and the flash-attn package")
        block_size = block_size or FLASH_BLOCK_SIZE_MULTIPLE
        if block_size % FLASH_BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"flash-attn's paged KV needs a block size that is a multiple of "
                             f"{FLASH_BLOCK_SIZE_MULTIPLE}, got {block_size}")
        return backend, block_size
    return backend, block_size or 16


def _reject_unsupported(module: torch.nn.Module, kwargs: dict) -> None:
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedAttentionFeature(
            f"model type {model_type!r} uses sliding-window attention, which batchgen does not support yet")
    if kwargs.get("softcap") is not None:
        raise UnsupportedAttentionFeature(
            f"model type {model_type!r} uses attention logit softcapping, which batchgen does not support")
    if kwargs.get("s_aux") is not None:
        raise UnsupportedAttentionFeature(
            f"model type {model_type!r} uses attention sinks, which batchgen does not support")


def register() -> None:
    """Register the attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
