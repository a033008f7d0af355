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
from batchgen.errors import UnsupportedModelError

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
    meta = current_metadata()
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention runs only inside batchgen's engine; "
                           "call model.set_attn_implementation('sdpa') to use the model directly")
    k_cache, v_cache = meta.kv_caches[layer_idx]
    k_scale = v_scale = None
    if meta.kv_scales is None:
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    else:  # int8 pages: quantized on write (one C call on CPU); k/v stay the model's, and the one
        # backend path attending over them directly (sdpa.prefill_forward) fake-quantizes them itself
        k_scale, v_scale = meta.kv_scales[layer_idx]
        kv_quant.write(k_cache, v_cache, k_scale, v_scale, meta.slot_mapping, k, v)

    layer = LayerKV(k_cache, v_cache, meta.block_size, k_scale, v_scale)
    return meta.backend.forward(q, k, v, layer, meta.step, scale)


@_paged_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


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


def check_model_supported(model) -> None:
    """Refuse, at engine start, a model whose attention this engine cannot run (the same features
    `_reject_unsupported` refuses per call, caught before any KV cache is allocated)."""
    config = getattr(model.config, "text_config", None) or model.config
    name = getattr(model.config, "name_or_path", None) or config.model_type
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(f"model {name!r} does not use transformers' attention interface")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"model {name!r} ({config.model_type}) uses {sorted(set(layer_types) - {'full_attention'})} "
            "layers; batchgen supports full-attention decoder models only")
    if getattr(config, "use_sliding_window", False) or (
            getattr(config, "sliding_window", None) and not hasattr(config, "use_sliding_window")
            and not layer_types):
        raise UnsupportedModelError(f"model {name!r} ({config.model_type}) uses sliding-window attention, "
                                    "which batchgen does not support")
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(f"model {name!r} ({config.model_type}) uses attention softcapping, "
                                    "which batchgen does not support")


def register() -> None:
    """Register the attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
