"""Paged attention for unmodified Hugging Face models, registered as "batchgen_paged".

The model runner packs every sequence of a step into one row (`input_ids [1, T]`) and sets an
`AttentionMetadata` in a forward context; transformers then calls `paged_attention_forward` once
per layer with that layer's q/k/v (RoPE already applied). With no mask function registered for
our name, transformers passes `attention_mask=None`: causality and the isolation between the
sequences packed into one row are enforced here.

Per layer the function writes the step's new K/V into the paged cache at `slot_mapping`, then
hands attention to the engine's backend, chosen once per engine (engine/attention/registry.py
names them and their rules). Each backend builds its own per-step metadata once
(`build_metadata`) and attends per layer (`forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.attention.base import AttentionBackend, LayerKV
from batchgen.engine.forward_context import current_metadata
from batchgen.engine.kv import quant as kv_quant
from batchgen.engine.score_rules import NO_RULES, ScoreRules

ATTN_IMPLEMENTATION = "batchgen_paged"


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention inputs, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot for each new token
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [num_slots, kv_heads, head_dim]
    block_size: int
    backend: AttentionBackend
    step: Any  # what `backend.build_metadata` built for this step
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # int8 pages: per layer k, v [num_slots, kv_heads]
    # the window the block manager drops blocks behind (kv/block_manager.py); every layer must attend it
    kv_window: int | None = None
    # several KV layer groups (kv/groups.py, kv/hybrid.py): each layer's group, and per group its
    # slot_mapping, backend step metadata and the window its blocks are kept for (None: all); the
    # fields above then serve no layer
    layer_group: tuple[int, ...] | None = None
    group_slot_mappings: list[torch.Tensor] | None = None
    group_steps: list[Any] | None = None
    group_windows: tuple[int | None, ...] | None = None
    # [S] the step's rows the LM head reads, where only they need the last layer's output
    # (engine/model/head_rows.py); None: every row
    head_rows: torch.Tensor | None = None


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The function transformers calls per layer; traceable, so torch.compile keeps one graph.

    The layer's own attention rules come as transformers passes them to every attention function:
    `scaling` (Gemma: query_pre_attn_scalar ** -0.5), `sliding_window` (the layer's window, None on
    full-attention layers), `softcap` (Gemma 2's attention logit softcapping) and `s_aux` (gpt-oss's
    per-head sinks). Everything that depends on the step (the metadata, the cache tensors) is read
    inside the opaque `batchgen::paged_attention` op at run time, never here, so a compiled forward
    neither breaks its graph at every layer nor guards on per-step Python objects.
    """
    # query: [1, num_heads, T, head_dim]; key/value: [1, num_kv_heads, T, head_dim]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.batchgen.paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                             value[0].transpose(0, 1), module.layer_idx, float(scale),
                                             int(sliding_window or 0), float(softcap or 0.0), s_aux)
    return out.unsqueeze(0), None  # [1, T, num_heads, head_dim]


@torch.library.custom_op("batchgen::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                        scale: float, sliding_window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    # q: [T, num_heads, head_dim]; k/v: [T, num_kv_heads, head_dim]; sinks: [num_heads] or None.
    # sliding_window 0 and softcap 0.0 mean none. Writes this layer's new K/V into the paged cache
    # (a side effect on tensors the compiler never sees) and attends.
    meta = current_metadata()
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention runs only inside batchgen's engine; "
                           "call model.set_attn_implementation('sdpa') to use the model directly")
    k_cache, v_cache = meta.kv_caches[layer_idx]
    slot_mapping, step, kept = meta.slot_mapping, meta.step, meta.kv_window
    if meta.layer_group is not None:
        group = meta.layer_group[layer_idx]
        slot_mapping, step, kept = meta.group_slot_mappings[group], meta.group_steps[group], meta.group_windows[group]
    k_scale = v_scale = None
    if meta.kv_scales is None:
        k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    else:  # int8 pages: quantized on write (one C call on CPU); k/v stay the model's, and the one
        # backend path attending over them directly (sdpa.prefill_forward) fake-quantizes them itself
        k_scale, v_scale = meta.kv_scales[layer_idx]
        kv_quant.write(k_cache, v_cache, k_scale, v_scale, slot_mapping, k, v)

    if kept is not None and not 0 < sliding_window <= kept:
        # blocks behind the window are gone: a layer attending further back would read other rows' K/V
        raise RuntimeError(f"layer {layer_idx} attends a window of {sliding_window or 'all'} tokens, but the KV "
                           f"cache keeps only the last {kept}: the model's config and its attention disagree")
    layer = LayerKV(k_cache, v_cache, meta.block_size, k_scale, v_scale)
    rules = NO_RULES
    if sliding_window or softcap or sinks is not None:
        rules = ScoreRules(sliding_window or None, softcap or None,
                           None if sinks is None else sinks.detach().float().contiguous())
    return meta.backend.forward(q, k, v, layer, step, scale, rules)


@_paged_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float, sliding_window: int,
      softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def register() -> None:
    """Register the attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
