"""LLM.int8()-style outlier decomposition for the oneDNN int8 layers (engine/quant/int8.py).

Why: a per-token int8 activation gets one scale per row, set by that row's largest value. Where a
few input channels run far above the rest in every token (decoder activations have such channels),
they set every token's scale and the other channels are left a handful of int8 levels. LLM.int8()
(Dettmers et al., 2022) takes those channels out of the int8 matmul and multiplies them in full
precision:

    x @ W^T  ==  x[:, R] @ W[:, R]^T  (int8, R: the regular channels)  +  x[:, O] @ W[:, O]^T  (bf16)

LLM.int8() finds O per call (any column holding a value over 6.0); here O is fixed per layer from
the calibration pass at load time (engine/quant/calibration.py): the channels whose range is
widest. A fixed set costs one index_select and one small [rows, k] x [k, out] matmul per call, and
the int8 operand keeps its shape:
the quantizer reads the outlier channels with factor 0 (so they neither set the token's scale nor
count in the int8 product) and their weight columns are zero in the int8 weight (so they no longer
widen each output row's weight scale either).
"""

from __future__ import annotations

import math

import torch


def outlier_channels(input_range: torch.Tensor, fraction: float) -> torch.Tensor | None:
    """The input channels to compute in full precision: the ceil(fraction * in) widest by their
    calibrated range max |x_j|, as sorted int64 indices; None when fraction is 0."""
    if fraction <= 0:
        return None
    seen = input_range.float()
    k = min(seen.numel(), max(1, math.ceil(round(fraction * seen.numel(), 6))))  # 0.05 * 120 is 6.000000000000001
    return torch.topk(seen, k).indices.sort().values.to(torch.int64)


# output columns per block of the bf16 dot-product layout (one AVX-512 register of float32 sums)
PAIR_LANES = 16


def pack_bf16_pairs(weight_t: torch.Tensor) -> torch.Tensor:
    """[k, cols] outlier weight rows -> csrc/finish_rows.h's bf16 dot-product layout:
    [ceil(cols / 16), ceil(k / 2), 16, 2] bf16, block b's pair p, lane c holding rows 2p and 2p + 1
    of column 16b + c (zeros pad an odd k and the last block). vdpbf16ps multiplies a pair of bf16
    inputs by such a register in one instruction, 32 products, from half the bytes of float32 rows;
    for a bf16 model the weight is bf16 already, so nothing is rounded."""
    k, cols = weight_t.shape
    kp, blocks = (k + 1) // 2, -(-cols // PAIR_LANES)
    padded = torch.zeros(2 * kp, blocks * PAIR_LANES, dtype=torch.bfloat16)
    padded[:k, :cols] = weight_t
    # [pair, 2, block, lane] -> [block, pair, lane, 2]
    return padded.view(kp, 2, blocks, PAIR_LANES).permute(2, 0, 3, 1).contiguous()


def unpack_bf16_pairs(packed: torch.Tensor, k: int, cols: int) -> torch.Tensor:
    """pack_bf16_pairs' inverse: [k, cols] bf16."""
    blocks, kp = packed.shape[:2]
    return packed.permute(1, 3, 0, 2).reshape(2 * kp, blocks * PAIR_LANES)[:k, :cols]

