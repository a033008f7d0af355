"""The last decoder layer's output projection and MLP run only on the rows the LM head reads.

A prefill chunk of T tokens samples at one position per row (a few with jump-forward drafts or
prompt logprobs): the head reads S of the T final hidden states. Every layer must still run on all
T tokens, since each layer's K/V of every token is what later tokens attend to, except for the
part of the last layer that comes after its K/V: its attention output projection and its MLP
(with the MoE router, where there is one) change only that layer's output, which nothing but the
head reads. In a prompt-heavy job (labelling, extraction) those two are most of a layer's
arithmetic, so the rows the head does not read skip them: the wrapped modules gather the head's
rows, run their own forward on them and scatter the result into zeros. The rows left at zero
carry the layer's residual onward unchanged: finite, and read by nobody. llama.cpp cuts its
graphs the same way (the output rows are selected in the last layer, after attention); here the
Hugging Face modules stay unmodified and only two module instances get a wrapping forward.

The model runner names the rows in the step's metadata (`AttentionMetadata.head_rows`) only when
nothing else reads the last layer's other rows: not with LoRA adapters in the step (their packed
row spans are the whole step's) and not in a compiled forward (which would guard on the count).
Outside an engine's forward (`model.generate`, the memory profile) the modules run as before.
"""

from __future__ import annotations

import logging
import types

import torch

from batchgen.engine.forward_context import current_metadata

log = logging.getLogger(__name__)

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")  # Llama/Qwen/Gemma/gpt-oss, Llama 4, Mixtral
ATTENTION_NAMES = ("self_attn", "attention")


def last_decoder_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last of the decoder's layer list, found the way transformers' own models hold it."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return None
    return layers[-1]


def install(model: torch.nn.Module) -> list[str]:
    """Wrap the last layer's MLP and attention output projection; returns what was wrapped (by
    attribute path). Idempotent; a model without the usual layout keeps its modules."""
    layer = last_decoder_layer(model)
    if layer is None:
        return []
    targets: list[tuple[str, torch.nn.Module]] = []
    for name in MLP_NAMES:
        if isinstance(getattr(layer, name, None), torch.nn.Module):
            targets.append((name, getattr(layer, name)))
            break
    for name in ATTENTION_NAMES:
        proj = getattr(getattr(layer, name, None), "o_proj", None)
        if isinstance(proj, torch.nn.Module):
            targets.append((f"{name}.o_proj", proj))
            break
    for _, module in targets:
        if not getattr(module, "_batchgen_head_rows", False):
            module.forward = types.MethodType(_make_forward(module.forward), module)
            module._batchgen_head_rows = True
    if targets:
        log.debug("last layer runs %s on the head's rows only", " and ".join(n for n, _ in targets))
    return [n for n, _ in targets]


def _make_forward(inner):
    """`inner` is the module's forward as it was (its own, or a fused one): a bound method."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        meta = current_metadata()
        rows = None if meta is None else meta.head_rows
        if rows is None or x.dim() < 2 or rows.numel() >= x.shape[-2]:
            return inner(x, *args, **kwargs)
        out = inner(x.index_select(-2, rows), *args, **kwargs)
        if not isinstance(out, torch.Tensor):  # an MoE block that also returns its router logits
            hidden, *rest = out
            return (_scatter(hidden, rows, x.shape[-2]), *rest)
        return _scatter(out, rows, x.shape[-2])

    return forward


def _scatter(part: torch.Tensor, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[..., S, H] at `rows` of a [..., num_tokens, H] zero tensor."""
    full = part.new_zeros((*part.shape[:-2], num_tokens, part.shape[-1]))
    return full.index_copy_(part.dim() - 2, rows, part)
