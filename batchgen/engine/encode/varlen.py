"""Attention over a packed batch, and the forward pass that runs a model on one.

`packed_forward` runs a Hugging Face base model on a PackedBatch as a single row [1, T]. The model's
attention modules call `varlen_attention` (registered in transformers' AttentionInterface under
VARLEN_ATTENTION); it reads the batch from this thread's packed context and lets each token attend only
within its own sequence: both ways for an encoder, causally for a decoder, inside the layer's sliding
window where it has one. On CUDA with flash-attn importable (float16 / bfloat16) that is flash-attn's
varlen kernel on the packed tokens; elsewhere one SDPA call over the tokens scattered into a
[rows, longest] layout with a key mask.

Outside a packed context the same names behave as transformers' SDPA attention and mask, so a model
switched to VARLEN_ATTENTION still runs its own padded forward correctly (a classifier's head check,
a padded fallback). Inside one, the registered mask function returns no mask: HF's masks would treat
the packed row as one sequence.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from batchgen.engine.encode.packing import PackedBatch, pack, position_rule
from batchgen.errors import UnsupportedModelError

VARLEN_ATTENTION = "batchgen_varlen"

_local = threading.local()


@dataclass(slots=True)
class PackedAttention:
    """What the attention function needs of the batch being run on this thread."""

    batch: PackedBatch
    causal: bool
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def padded_mask(self, window: int | None) -> torch.Tensor | None:
        """bool [rows, 1, L, L] (True: attend) for the padded layout, or None where every key of every
        row may be attended (equal lengths, no causality, no window). `window`: the largest distance
        between a query and a key it attends."""
        if window not in self._masks:
            _, valid = self.batch.padded_layout()
            longest = valid.shape[1]
            if window is None and not self.causal and all(n == longest for n in self.batch.lengths):
                self._masks[window] = None
            else:
                positions = torch.arange(longest, device=valid.device)
                distance = positions[:, None] - positions[None, :]  # query minus key
                allowed = torch.ones(longest, longest, dtype=torch.bool, device=valid.device)
                if self.causal:
                    allowed &= distance >= 0
                if window is not None:
                    allowed &= distance.abs() <= window
                self._masks[window] = valid[:, None, None, :] & allowed[None, None]
        return self._masks[window]


def current_packed() -> PackedAttention | None:
    return getattr(_local, "packed", None)


@contextlib.contextmanager
def packed_context(packed: PackedAttention) -> Iterator[None]:
    assert current_packed() is None, "packed contexts do not nest"
    _local.packed = packed
    try:
        yield
    finally:
        _local.packed = None


@functools.cache
def _flash_varlen():
    """flash-attn's varlen function, or None where the package is not importable."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs
                     ) -> tuple[torch.Tensor, None]:
    """HF attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    packed = current_packed()
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(f"{type(module).__name__}: attention sinks are not supported in a packed forward")
    assert query.shape[0] == 1 and query.shape[2] == packed.batch.num_tokens, (query.shape, packed.batch.num_tokens)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # HF passes the flash-attn convention: a window of w covers distances up to w - 1
    window = sliding_window - 1 if sliding_window else None
    flash = _flash_varlen() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    if flash is not None:
        batch = packed.batch
        cu = batch.cu_seqlens_tensor()
        out = flash(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu,
                    batch.max_len, batch.max_len, softmax_scale=scale, causal=packed.causal,
                    window_size=(window, window) if window is not None else (-1, -1),
                    softcap=softcap or 0.0)
        return out[None], None
    return _padded_attention(packed, query, key, value, scale, window, softcap), None


def _padded_attention(packed: PackedAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    index, valid = packed.batch.padded_layout()

    def padded(x: torch.Tensor) -> torch.Tensor:  # [1, h, T, D] -> [rows, h, L, D]
        return x[0].transpose(0, 1)[index].transpose(1, 2)

    q, k, v = padded(query), padded(key), padded(value)
    if packed.causal and window is None and not softcap:
        # rows are right-padded, so every key a real query may see is a real token of its own row:
        # causality alone isolates the rows, and without a mask SDPA takes its fused kernel (and reads
        # grouped K/V heads in place); the padded queries' outputs are dropped below
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)[valid][None]
    mask = packed.padded_mask(window)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if softcap:  # SDPA has no score cap: the scores are made here
        scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)[valid][None]  # [1, T, H, D]


def varlen_mask(*args, **kwargs) -> torch.Tensor | None:
    """HF mask interface: no mask inside a packed forward (attention isolates the sequences), SDPA's
    mask outside one."""
    if current_packed() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_ATTENTION, varlen_mask)


def use_varlen_attention(model: PreTrainedModel) -> None:
    """Switch the model (and the sub-models sharing its config) to the packed attention function."""
    register()
    if model.config._attn_implementation != VARLEN_ATTENTION:
        model.set_attn_implementation(VARLEN_ATTENTION)


@functools.cache
def _takes(forward_class: type, name: str) -> bool:
    return name in inspect.signature(forward_class.forward).parameters


@torch.no_grad()
def packed_forward(model: PreTrainedModel, batch: PackedBatch, *, causal: bool) -> torch.Tensor:
    """The last hidden states [T, hidden] of a base model (BertModel, XLMRobertaModel, ModernBertModel,
    a decoder stack such as Qwen3Model) over a packed batch. `causal`: the model's attention is a
    decoder's (each token sees its own sequence's earlier tokens) rather than an encoder's."""
    use_varlen_attention(model)
    kwargs = {}
    if _takes(type(model), "use_cache"):
        kwargs["use_cache"] = False
    with packed_context(PackedAttention(batch, causal)):
        out = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], **kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]


def pack_for(model: PreTrainedModel, rows, device: torch.device | str | None = None) -> PackedBatch:
    """`pack` with the model's position numbering, on the model's device."""
    if device is None:
        device = next(model.parameters()).device
    return pack(rows, rule=position_rule(model), device=device)
