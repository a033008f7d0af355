"""`--quantize int8` on oneDNN applied to a whole model: which linear layers, the calibration
pass, the stacked siblings, each layer's smoothing factors, outlier channels and activation form.
The switches are quantize_recipe's (INT8_FULL_PRECISION_LAYERS, INT8_LM_HEAD,
INT8_SMOOTH_ALPHA(_BY_LAYER), INT8_OUTLIER_FRACTION(_BY_LAYER)/LAYERS, INT8_ASYMMETRIC_LAYERS,
INT8_STACK_SIBLINGS); the layers are engine/quant/int8.py's, the stacking
engine/quant/int8_siblings.py's, the smoothing engine/quant/smooth.py's, the outlier channels
engine/quant/outliers.py's.
"""

from __future__ import annotations

import torch

from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import int8_siblings as quantize_int8_siblings
from batchgen.engine.quant import outliers as quantize_outliers
from batchgen.engine.quant import smooth as quantize_smooth
from batchgen.engine.quant.recipe import (
    INT8_ASYMMETRIC_LAYERS,
    INT8_FULL_PRECISION_LAYERS,
    INT8_LM_HEAD,
    INT8_OUTLIER_FRACTION,
    INT8_OUTLIER_FRACTION_BY_LAYER,
    INT8_OUTLIER_LAYERS,
    INT8_SMOOTH_ALPHA,
    INT8_SMOOTH_ALPHA_BY_LAYER,
    INT8_STACK_SIBLINGS,
)


def calibrated() -> bool:
    """Whether the recipe needs a calibration pass (smoothing factors or outlier channels)."""
    return INT8_SMOOTH_ALPHA is not None or INT8_OUTLIER_FRACTION > 0 or any(
        f > 0 for f in INT8_OUTLIER_FRACTION_BY_LAYER.values())


def quantize_layers(model: torch.nn.Module, names: set[str], calibration: list[list[int]] | None,
                    with_head: bool) -> tuple[int, bool]:
    """Swap the decoder linear layers `names` (and the LM head when `with_head` and INT8_LM_HEAD)
    for oneDNN int8 layers, smoothed and with outlier channels from `calibration` token ids when
    given and the recipe asks for them. Returns (how many linear layers were quantized, whether the
    calibration pass ran)."""
    if INT8_FULL_PRECISION_LAYERS:
        names = {n for n in names if n.rpartition(".")[2] not in INT8_FULL_PRECISION_LAYERS}
    head = model.get_output_embeddings()
    if INT8_LM_HEAD and with_head and type(head) is torch.nn.Linear:
        # the LM head as one more int8 x int8 layer (a tied embedding keeps its own full-precision matrix)
        names = names | {next(n for n, m in model.named_modules() if m is head)}
    count = len(names)
    ranges = None
    if calibration and calibrated():
        ranges = quantize_smooth.input_ranges(model, names, calibration)
    parents = dict(model.named_modules())
    if INT8_STACK_SIBLINGS:  # q/k/v and gate/up as one matmul each
        names = _stack_siblings(parents, names, ranges)
    for name in sorted(names):
        parent, _, child = name.rpartition(".")
        linear = getattr(parents[parent], child)
        smooth, outliers = _calibrated_parts(ranges, name, [child], linear.weight)
        quantize_int8.quantize_linear(parents[parent], child, smooth, outliers, child in INT8_ASYMMETRIC_LAYERS)
    return count, ranges is not None


def _calibrated_parts(ranges: dict[str, torch.Tensor] | None, name: str, children: list[str],
                      weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(smoothing factors, outlier channels) of the layer (or stacked set of `children`) whose
    input is layer `name`'s, with `weight` [out, in]; (None, None) uncalibrated."""
    if ranges is None:
        return None, None
    smooth = None
    alpha = INT8_SMOOTH_ALPHA_BY_LAYER.get(children[0], INT8_SMOOTH_ALPHA)
    if alpha is not None:
        smooth = quantize_smooth.smoothing_factors(ranges[name], weight, alpha)
    outliers = None
    if not INT8_OUTLIER_LAYERS or any(c in INT8_OUTLIER_LAYERS for c in children):
        fraction = next((INT8_OUTLIER_FRACTION_BY_LAYER[c] for c in children if c in INT8_OUTLIER_FRACTION_BY_LAYER),
                        INT8_OUTLIER_FRACTION)
        outliers = quantize_outliers.outlier_channels(ranges[name], smooth, fraction)
    return smooth, outliers


def _stack_siblings(parents: dict[str, torch.nn.Module], names: set[str],
                    ranges: dict[str, torch.Tensor] | None) -> set[str]:
    """Swap each q/k/v and gate/up set among `names` for one stacked oneDNN int8 matmul; returns
    the names left to quantize one by one."""
    left = set(names)
    for parent, children in quantize_int8_siblings.sibling_sets(names):
        # one input, so one range; the factors see every sibling's weight
        weight = torch.cat([getattr(parents[parent], c).weight.detach() for c in children])
        smooth, outliers = _calibrated_parts(ranges, f"{parent}.{children[0]}", children, weight)
        asymmetric = any(c in INT8_ASYMMETRIC_LAYERS for c in children)
        quantize_int8_siblings.stack(parents[parent], children, smooth, outliers, asymmetric)
        left -= {f"{parent}.{c}" for c in children}
    return left
