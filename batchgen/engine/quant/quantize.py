"""Weight quantization: a module/tensor swap of the decoder's linear layers, one layer at a time.

Applied after loading, or, for a local safetensors checkpoint on CPU, while loading: each layer as
its weight is read (engine/model/stream_load.py), so the full-precision model never exists whole.

The HF forward stays as it is: torchao replaces each `nn.Linear.weight` by a tensor subclass
whose `F.linear` runs a quantized kernel; optimum-quanto swaps each `nn.Linear` for its `QLinear`.
Both keep working under our packed forward and paged attention, which never touch the weights.

Schemes (`--quantize`):
  int8         int8 weights per output row + int8 activations per token, quantized on the fly
               (torchao's dynamic-activation path; quanto quantizes activations only statically,
               with calibration, so it is not offered), or oneDNN's int8 x int8 matmul with
               --quantize-backend onednn (engine/quant/int8.py; auto's choice on a CPU with
               AVX-512 VNNI or AMX), whose recipe (quantize_recipe.INT8_RECIPE) adds LLM.int8()-style
               outlier channels from a calibration pass (engine/quant/calibration.py) and runs q/k/v
               and gate/up as one stacked matmul each (engine/quant/int8_siblings.py), applied to
               the model by engine/quant/int8_model.py
  int8-weight  int8 weights per output row, activations stay in the model dtype
  int4         int4 weights in groups of 32 input channels (the MLP gate projections: 64), asymmetric
               (engine/quant/recipe.py)

The embedding and LM head (`--quantize-embedding`): int8 per row, one shared matrix when tied
(engine/quant/embedding.py, the same for both backends); `auto` does that for int4 (measured in
benchmarks/quant/quality.py: see quantize_plan.EMBEDDING_AUTO) and leaves it in full precision otherwise.
What stays in full precision: norms, and any linear layer whose input width the scheme's group size
does not divide (logged).

What a model gets (the scheme, the backend `auto` picks per device, the embedding, the refusals) is
planned before any weight is touched, in engine/quant/plan.py; this module applies that plan.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from batchgen.engine.quant.checkpoint import check_prequantized, checkpoint_quantization
from batchgen.engine.quant.embedding import quantize_embeddings
from batchgen.engine.quant.plan import Quantization, plan_quantization, requested_scheme
from batchgen.engine.quant.recipe import (
    INT4_COARSE_GROUP_SIZE,
    INT4_COARSE_LAYERS,
    INT4_GROUP_SIZE,
)
from batchgen.errors import ConfigError

log = logging.getLogger(__name__)


def quantize_model(model: torch.nn.Module, scheme: str, backend: str = "auto",
                   embedding: str = "auto", calibration: list[list[int]] | None = None) -> Quantization:
    """Quantize `model`'s decoder linear layers (and, per `embedding`, its embedding/LM head) in
    place; return what was applied. `calibration`: token ids the full-precision model runs first
    where the scheme calibrates (Quantization.calibrated; the loader passes
    quantize_calibration.calibration_ids); without them such a scheme runs uncalibrated (the label says so)."""
    device = next(model.parameters()).device
    plan = plan_quantization(model.config, scheme, backend, embedding, device)
    if plan.scheme == "none":
        if plan.embedding != "none":
            quantize_embeddings(model)
        return plan
    names = quantizable_linear_names(model, linear_group_size(plan))
    if plan.backend == "onednn":  # its recipe: calibration, stacking
        from batchgen.engine.quant import int8_model as quantize_int8_model

        count, calibrated = quantize_int8_model.quantize_layers(model, names, calibration)
        plan = dataclasses.replace(plan, calibrated_run=calibrated)
    else:
        parents = dict(model.named_modules())
        for name in sorted(names):
            parent, _, child = name.rpartition(".")
            quantize_linear(parents[parent], child, plan, device.type)
        count = len(names)
    if plan.embedding != "none":
        quantize_embeddings(model)
    log.info("quantized %d linear layers to %s with %s%s", count, plan.scheme, plan.backend,
             "" if plan.embedding == "none" else f", the embedding/LM head to {plan.embedding}")
    return plan


def linear_group_size(plan: Quantization) -> int:
    """The input-width divisor a linear layer needs under `plan` (1: any): int4's finest group."""
    return INT4_GROUP_SIZE if plan.scheme == "int4" else 1


def int4_group_size(child: str, in_features: int) -> int:
    """The int4 group size of the linear layer named `child` (the recipe above)."""
    if child in INT4_COARSE_LAYERS and in_features % INT4_COARSE_GROUP_SIZE == 0:
        return INT4_COARSE_GROUP_SIZE
    return INT4_GROUP_SIZE


def quantize_linear(parent: torch.nn.Module, child: str, plan: Quantization, device_type: str) -> None:
    """Quantize the linear layer `parent.<child>` alone: the unit both the after-load pass and the
    streaming loader (engine/model/stream_load.py) apply, so the two give the same weights (an int8/onednn
    model is quantized after load by engine/quant/int8_model.py, which calibrates and stacks)."""
    if plan.backend == "torchao":
        _quantize_torchao(parent, plan.scheme, child, device_type)
    elif plan.backend == "onednn":
        from batchgen.engine.quant import int8 as quantize_int8

        quantize_int8.quantize_linear(parent, child)
    else:
        _quantize_quanto(parent, plan.scheme, child)


def quantizable_linear_names(model: torch.nn.Module, group_size: int) -> set[str]:
    """Every nn.Linear but the LM head, whose input width `group_size` divides."""
    head = model.get_output_embeddings()
    names, skipped = set(), []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            (names.add if module.in_features % group_size == 0 else skipped.append)(name)
    if skipped:
        log.info("left %d linear layers in full precision (input width not a multiple of %d): %s",
                 len(skipped), group_size, ", ".join(skipped[:4]))
    return names


def torchao_int4_config(group_size: int, device_type: str = "cpu"):
    """torchao's int4 weight-only config for the device.

    One shim because its CPU variant moves between releases: 0.18 keeps it in
    `torchao.prototype.quantization.int4` (an opaque packed tensor for aten's
    `_weight_int4pack_mm_for_cpu`); earlier ones spelled it `Int4WeightOnlyConfig(layout=Int4CPULayout())`
    or `int4_packing_format="opaque"`.
    """
    from torchao.quantization import Int4WeightOnlyConfig

    if device_type != "cpu":
        return Int4WeightOnlyConfig(group_size=group_size)
    try:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        return PrototypeInt4WeightOnlyConfig(group_size=group_size)
    except ImportError:
        pass
    try:
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="opaque")
    except TypeError:
        from torchao.dtypes import Int4CPULayout
        return Int4WeightOnlyConfig(group_size=group_size, layout=Int4CPULayout())


def _quantize_torchao(parent: torch.nn.Module, scheme: str, child: str, device_type: str) -> None:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    if scheme == "int4":
        config = torchao_int4_config(int4_group_size(child, getattr(parent, child).in_features), device_type)
    else:
        config = {"int8": Int8DynamicActivationInt8WeightConfig, "int8-weight": Int8WeightOnlyConfig}[scheme]()
    if hasattr(config, "set_inductor_config"):
        config.set_inductor_config = False  # we run eagerly; leave the process's inductor settings alone
    quantize_(parent, config, filter_fn=lambda module, fqn: fqn == child)


def _quantize_quanto(parent: torch.nn.Module, scheme: str, child: str) -> None:
    from optimum.quanto import freeze, qint4, qint8, quantize

    weights = {"int8-weight": qint8, "int4": qint4}[scheme]
    # quanto's `include` takes fnmatch patterns relative to the module passed; a plain child name
    # matches only that child (quanto swaps it for a QLinear on `parent`)
    quantize(parent, weights=weights, include=[child])
    module = getattr(parent, child)
    if scheme == "int4":
        # quanto picks its own group size (128, else 96 for SmolLM2's 576); int4 means one recipe
        # on both backends, set before freeze() quantizes the weight
        module.weight_group_size = int4_group_size(child, module.in_features)
    freeze(module)
    if scheme == "int4":
        module.forward = _outside_inference_mode(module.forward)


def _outside_inference_mode(forward):
    """quanto 0.2.7's int4 linear goes through an autograd.Function whose `weight.t()` fails under
    torch.inference_mode ("Cannot set version_counter for inference tensor"), where our runner
    steps; it runs with inference mode off on a normal copy of its input (same values)."""

    def wrapped(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():
            return forward(x.clone() if x.is_inference() else x)

    return wrapped


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the parameters and buffers hold, counting a quantized tensor's inner tensors once."""
    seen: set[int] = set()
    total = 0

    def visit(t: torch.Tensor) -> None:
        nonlocal total
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
            inner, _ = flatten()
            for attr in inner:
                visit(getattr(t, attr))
            return
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()

    for t in [*model.parameters(), *model.buffers()]:
        visit(t)
    for module in model.modules():  # oneDNN's reordered weights (engine/quant/int8.py): opaque, no storage
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, torch.Tensor) and packed.is_mkldnn:
            total += int(torch.ops.mkldnn._nbytes(packed))
    return total


# ---------------------------------------------------------------- at load time (engine/model/loader.py)

def apply_at_load(model: torch.nn.Module, name: str, scheme: str, backend: str, gguf_path=None,
                  embedding: str = "auto", tokenizer=None) -> str:
    """What loader.load_model calls after moving the model: returns the label the job fingerprint
    records ("none", "int4/torchao+int8-embedding", "prequantized:torchao", ...)."""
    method = checkpoint_quantization(model)
    if method is not None:
        check_prequantized(method, name)
        if scheme not in ("none", "auto"):
            raise ConfigError(f"model {name!r} is already quantized ({method}); drop --quantize {scheme}")
        return f"prequantized:{method}"
    scheme = requested_scheme(scheme, name, gguf_path)
    calibration = None
    device = next(model.parameters()).device
    if tokenizer is not None and plan_quantization(model.config, scheme, backend, embedding, device).calibrated:
        from batchgen.engine.quant.calibration import calibration_ids

        calibration = calibration_ids(tokenizer)  # only where the scheme calibrates: tokenizing costs start-up
    return quantize_model(model, scheme, backend, embedding, calibration).label

