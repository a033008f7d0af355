"""SmoothQuant-style per-input-channel smoothing for the dynamic int8 linear layers (engine/quant/int8.py).

Why: per-token int8 activations lose most where a few input channels run far above the rest (on
SmolLM2-135M the widest channel of a down_proj input spans many times the median channel's
range). The outlier sets the token's scale, and every other channel of that token is
left a handful of int8 levels. SmoothQuant
(Xiao et al., 2023) moves part of that range into the weight, which is quantized per output row
and has room to spare: for an input channel j with activation range a_j and weight range w_j,

    s_j = a_j ** alpha / w_j ** (1 - alpha)      x' = x / s      W' = W * s     x' @ W'^T == x @ W^T

Here the 1/s factor is not folded into a preceding norm or projection: it is applied inside the
activation quantizer (csrc/pointwise.c: quantize_rows_u8_scaled, a float32 multiply in the pass
that already reads x), so every linear layer can be smoothed (o_proj and down_proj too, whose
inputs come from attention and SiLU(gate) * up, not from a norm), the model's own modules and
weights stay as they are, and the only cost is the quantizer's extra multiply.
s_j is rounded to a power of two, so W * s and x / s are exact in float and a factor computed on
another machine (another thread count, a last-bit difference in a_j) rarely changes any weight.

a_j comes from a calibration pass: the full-precision model runs CALIBRATION_PROMPTS (fixed text
below, chat-formatted with the model's own template) once, before its linear layers are swapped,
and a forward hook keeps each layer's max |x_j|. The text is part of the recipe, so the same model
always gets the same factors (a resumed job recomputes them and gets the same weights).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_FLOOR = 1e-5  # a channel never seen (or all-zero) keeps factor ~1, not 0 or inf

# Fixed calibration text: a few short chat turns of the kinds of jobs batchgen runs (summaries,
# questions, code, extraction, open-ended writing). Only each channel's max is kept, so a few
# hundred tokens that exercise the model's usual outlier channels are enough.
CALIBRATION_PROMPTS = (
    "Summarize the following text in two sentences.\n\nThe Python standard library provides a module "
    "named json for reading and writing JSON documents. Its functions load and dump work on files, "
    "while loads and dumps work on strings. Custom encoders can be passed to handle types that JSON "
    "does not support, such as dates or decimal numbers.",
    "What are the main differences between a process and a thread in an operating system? Answer "
    "briefly, then give one example where each is the better choice.",
    "Write a Python function that returns the n-th Fibonacci number using iteration, with a docstring "
    "and a short test.\n\ndef fib(n: int) -> int:",
    "Extract the names, dates and amounts from this invoice as JSON: Invoice #4471 issued on March 3, "
    "2024 by Northwind Traders to Alice Martin. Total due: $1,284.50, payable within 30 days.",
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle. Keep it under "
    "150 words and give it a hopeful ending.",
    "Translate to French: The meeting has been moved to Thursday afternoon because the projector in "
    "the main room is broken.",
    "Explain why the sky is blue to a ten-year-old, then to a physics student.",
    "List five tips for writing clear technical documentation, with one sentence on each.",
)


def calibration_ids(tokenizer) -> list[list[int]]:
    """CALIBRATION_PROMPTS as token ids, through the model's chat template when it has one."""
    out = []
    for text in CALIBRATION_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids))
    return out


@torch.inference_mode()
def input_ranges(model: torch.nn.Module, names: set[str], token_ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens of each named linear layer's input: {name: [in] float32}."""
    ranges: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def hook_for(name):
        def hook(module, args, output):
            x = args[0].detach()
            amax = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
            ranges[name] = amax if name not in ranges else torch.maximum(ranges[name], amax)
        return hook

    hooks = [modules[name].register_forward_hook(hook_for(name)) for name in sorted(names)]
    device = next(model.parameters()).device
    try:
        for ids in token_ids:
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return ranges


def smoothing_factors(input_range: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [in] float32, a power of two per input channel: a^alpha / w^(1 - alpha), see the module docstring.
    alpha (SmoothQuant's migration strength: the share of each channel's range moved into the
    weight) is quantize_recipe.INT8_SMOOTH_ALPHA."""
    a = input_range.float().clamp(min=_FLOOR)
    w = weight.detach().float().abs().amax(0).clamp(min=_FLOOR)
    s = a.pow(alpha) / w.pow(1 - alpha)
    return torch.exp2(torch.log2(s).round())
