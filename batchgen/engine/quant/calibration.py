"""The calibration pass of `--quantize int8` on oneDNN (engine/quant/int8_model.py): each linear
layer's input range per channel, from which engine/quant/outliers.py picks the channels computed
outside the int8 matmul.

Why a pass at load time: the outlier channels are the input channels whose activations run far
above the rest in every token; which ones they are is a property of the model, seen only by running
it. The full-precision model runs CALIBRATION_PROMPTS (fixed text below, chat-formatted with the
model's own template) once, before its linear layers are swapped, and a forward hook keeps each
layer's max |x_j|. The text is part of the recipe, so the same model always gets the same channels
(a resumed job recomputes them and gets the same weights).
"""

from __future__ import annotations

import torch

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
