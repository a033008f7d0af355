"""LLM.int8()-style outlier decomposition for the oneDNN int8 layers (engine/quantize_int8.py).

Why: a per-token int8 activation gets one scale per row, set by that row's largest value. Where a
few input channels run far above the rest in every token (decoder activations have such channels),
they set every token's scale and the other channels are left a handful of int8 levels. LLM.int8()
(Dettmers et al., 2022) takes those channels out of the int8 matmul and multiplies them in full
precision:

    x @ W^T  ==  x[:, R] @ W[:, R]^T  (int8, R: the regular channels)  +  x[:, O] @ W[:, O]^T  (bf16)

LLM.int8() finds O per call (any column holding a value over 6.0); here O is fixed per layer from
the calibration pass smoothing already runs (engine/quantize_smooth.py): the channels whose range,
as the activation quantizer sees it (after the smoothing factor), is widest. A fixed set costs one
index_select and one small [rows, k] x [k, out] matmul per call, and the int8 operand keeps its shape:
the quantizer reads the outlier channels with factor 0 (so they neither set the token's scale nor
count in the int8 product) and their weight columns are zero in the int8 weight (so they no longer
widen each output row's weight scale either; smoothing had moved part of their range there).
"""

from __future__ import annotations

import math

import torch


def outlier_channels(input_range: torch.Tensor, smooth: torch.Tensor | None, fraction: float) -> torch.Tensor | None:
    """The input channels to compute in full precision: the ceil(fraction * in) widest by the range
    the activation quantizer sees (max |x_j| / s_j with smoothing factors s, else max |x_j|), as
    sorted int64 indices; None when fraction is 0."""
    if fraction <= 0:
        return None
    seen = input_range.float() if smooth is None else input_range.float() / smooth.float()
    k = min(seen.numel(), max(1, math.ceil(round(fraction * seen.numel(), 6))))  # 0.05 * 120 is 6.000000000000001
    return torch.topk(seen, k).indices.sort().values.to(torch.int64)
