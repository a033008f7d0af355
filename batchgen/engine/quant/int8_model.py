"""`--quantize int8` on oneDNN applied to a whole model: the calibration pass, the stacked siblings,
each layer's outlier channels and activation form, as engine/quant/recipe.py's int8 recipe says
(INT8_OUTLIER_FRACTION, INT8_ASYMMETRIC_LAYERS). The layers are engine/quant/int8.py's, the
stacking engine/quant/int8_siblings.py's, the calibration pass engine/quant/calibration.py's, the
outlier channels engine/quant/outliers.py's.
"""

from __future__ import annotations

import torch

from batchgen.engine.quant import calibration as quantize_calibration
from batchgen.engine.quant import int8 as quantize_int8
from batchgen.engine.quant import int8_siblings as quantize_int8_siblings
from batchgen.engine.quant import outliers as quantize_outliers
from batchgen.engine.quant.recipe import INT8_ASYMMETRIC_LAYERS, INT8_OUTLIER_FRACTION


def quantize_layers(model: torch.nn.Module, names: set[str], calibration: list[list[int]] | None) -> tuple[int, bool]:
    """Swap the decoder linear layers `names` for oneDNN int8 layers, q/k/v and gate/up stacked,
    with outlier channels from `calibration` token ids when given (without them: plain per-token
    int8). Returns (how many linear layers were quantized, whether the calibration pass ran)."""
    count = len(names)
    ranges = quantize_calibration.input_ranges(model, names, calibration) if calibration else None
    parents = dict(model.named_modules())
    names = _stack_siblings(parents, names, ranges)  # q/k/v and gate/up as one matmul each
    for name in sorted(names):
        parent, _, child = name.rpartition(".")
        quantize_int8.quantize_linear(parents[parent], child, _outliers(ranges, name), child in INT8_ASYMMETRIC_LAYERS)
    return count, ranges is not None


def _outliers(ranges: dict[str, torch.Tensor] | None, name: str) -> torch.Tensor | None:
    """The outlier channels of the layer (or stacked set) whose input is layer `name`'s; None uncalibrated."""
    if ranges is None:
        return None
    return quantize_outliers.outlier_channels(ranges[name], INT8_OUTLIER_FRACTION)


def _stack_siblings(parents: dict[str, torch.nn.Module], names: set[str],
                    ranges: dict[str, torch.Tensor] | None) -> set[str]:
    """Swap each q/k/v and gate/up set among `names` for one stacked oneDNN int8 matmul; returns
    the names left to quantize one by one."""
    left = set(names)
    for parent, children in quantize_int8_siblings.sibling_sets(names):
        # one input, so one range and one set of outlier channels
        quantize_int8_siblings.stack(parents[parent], children, _outliers(ranges, f"{parent}.{children[0]}"))
        left -= {f"{parent}.{c}" for c in children}
    return left
