"""Fused CPU kernels for the pointwise chains of Llama-style models: RMSNorm, SiLU(gate) * up and
the rotary embedding.

In eager PyTorch these chains are many small ops, each a pass over the activations, a dispatch and
an OpenMP wake-up, which together make a real share of a small model's step. Each becomes one C call
(csrc/pointwise.c, bound by engine/kernels/pointwise.py).

The model stays the Hugging Face model: only the `forward` of matching module instances is
replaced, and only where the replacement computes what the original does. A module matches when
its class's forward is, bytecode for bytecode, transformers' Llama RMSNorm or Llama MLP forward
(the classes transformers copies into Mistral, Qwen2, Qwen3, SmolLM and others), with a SiLU
activation for the MLP. Anything else keeps its own forward. bf16 and float32: in float32 the
only difference from the eager ops is the norm's summation order and the SiLU's exp (about 1 ulp),
the kind of difference oneDNN's float32 linears (engine/model/prepack.py) already make; greedy output
still equals `model.generate` in the engine's tests. In float32 too the eager chains are separate
passes (mul, silu, add, pow, mean, cat, neg) worth fusing. A float32
model with quantized linear layers keeps the eager ops: their activations are quantized per token,
which turns a 1-ulp difference in a norm's output into another int8 value, and then into another
greedy token than the eager model's (measured on a torchao int8 checkpoint of the tiny test model).

The rotary embedding is a module-level function (`apply_rotary_pos_emb`) that the attention
forward looks up in its modeling module, not a module of its own, so it is replaced there, in
that modeling module, once it matches Llama's bytecode for bytecode. The replacement takes the
fused path only inside a batchgen engine's forward (a `model.generate` beside it runs the original)
and only for bf16/float32 CPU tensors without autograd laid out as those forwards lay them out; it rounds
as the eager ops round (the same bits). Being module-level, it stays for the process once an
engine fused, also for a later engine built with `fuse_pointwise=False`, with the same results.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types

import torch
import torch.nn.functional as F

from batchgen.engine.forward_context import current_metadata
from batchgen.engine.kernels.common import FLOAT_CODES
from batchgen.engine.kernels.pointwise import PointwiseKernels, load, rope_layout_ok, rows_view

log = logging.getLogger(__name__)


def _plain_function(fn):
    """The Python function behind `fn`: transformers (5.25 on) wraps functions such as
    apply_rotary_pos_emb in a `kernels` hub module (`use_kernel_forward_from_hub`) whose forward calls
    the original unless a hub kernel was selected; its closure holds that original."""
    if hasattr(fn, "__code__") or not isinstance(fn, torch.nn.Module):
        return fn
    closure = getattr(type(fn).forward, "__closure__", None) or ()
    inner = [c.cell_contents for c in closure if inspect.isfunction(c.cell_contents)]
    return inner[0] if len(inner) == 1 else fn


def _same_code(fn, reference) -> bool:
    a, b = getattr(_plain_function(fn), "__code__", None), getattr(_plain_function(reference), "__code__", None)
    return (a is not None and b is not None and a.co_code == b.co_code and a.co_names == b.co_names
            and a.co_consts == b.co_consts)


def _references():
    from transformers.models.llama import modeling_llama

    return modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaMLP.forward


def _rope_references():
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb, modeling_llama.rotate_half


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return type(act) in (torch.nn.SiLU, SiLUActivation)


def _fast_path(x: torch.Tensor) -> bool:
    # under autograd, or on an unexpected tensor, the module's own forward runs
    return x.dtype in FLOAT_CODES and x.device.type == "cpu" and x.is_contiguous() and not torch.is_grad_enabled()


def _has_quantized_layers(model: torch.nn.Module) -> bool:
    """Any layer whose weight is not a plain float tensor: a torchao tensor subclass, quanto's
    QLinear, batchgen's oneDNN int8 layer (its packed int8 weight), an integer dtype."""
    for module in model.modules():
        if type(module).__module__.startswith(("optimum.quanto", "torchao", "batchgen.engine.quant.quantize")):
            return True
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            data = weight.data if isinstance(weight, torch.nn.Parameter) else weight
            if type(data) is not torch.Tensor or not data.is_floating_point():
                return True
    return False


def fuse_pointwise(model: torch.nn.Module) -> int:
    """Give matching RMSNorm and MLP modules the fused forwards; returns how many. Idempotent."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype not in FLOAT_CODES:
        return 0
    if param.dtype == torch.float32 and _has_quantized_layers(model):
        return 0
    kernels = load()
    if kernels is None:
        return 0
    norm_ref, mlp_ref = _references()
    count = newly = 0
    decisions: dict[str, str] = {}  # module class -> what was decided, logged once per model
    for module in model.modules():
        if getattr(module, "_batchgen_fused", False):  # a second engine on the same model
            count += 1
            continue
        forward = getattr(type(module), "forward", None)
        if _same_code(forward, norm_ref) and isinstance(getattr(module, "weight", None), torch.Tensor) \
                and module.weight.dtype == param.dtype and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_make_norm_forward(kernels, forward), module)
            decisions[type(module).__name__] = "fused (Llama's RMSNorm)"
        elif _same_code(forward, mlp_ref) and _is_silu(getattr(module, "act_fn", None)):
            module.forward = types.MethodType(_make_mlp_forward(kernels, forward), module)
            decisions[type(module).__name__] = "fused (Llama's SiLU(gate) * up MLP)"
        else:
            why = _why_not_fused(module, forward, norm_ref, mlp_ref)
            if why:
                decisions.setdefault(type(module).__name__, f"kept its own forward ({why})")
            continue
        module._batchgen_fused = True
        count += 1
        newly += 1
    if newly or decisions:
        log.debug("fused CPU kernels for %d RMSNorm/MLP modules: %s", newly,
                  "; ".join(f"{name} {what}" for name, what in sorted(decisions.items())) or "none")
    fuse_rope(model, kernels)
    return count


def _why_not_fused(module: torch.nn.Module, forward, norm_ref, mlp_ref) -> str | None:
    """Why a norm or MLP module keeps its own forward (its math differs from what the kernels
    compute: Gemma's (1 + weight) norm, a GELU-tanh MLP, an MoE block); None for other modules."""
    name = type(module).__name__
    if _same_code(forward, mlp_ref):
        return f"activation {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    if "Norm" in name:
        return "not Llama's RMSNorm forward" if not _same_code(forward, norm_ref) else "weight dtype or layout"
    if "MLP" in name or "Experts" in name or "MoE" in name or "Moe" in name:
        return "not Llama's MLP forward"
    return None


def fuse_rope(model: torch.nn.Module, kernels: PointwiseKernels) -> list[str]:
    """Replace `apply_rotary_pos_emb` in the modeling modules of `model`'s attention layers where it
    is Llama's; returns those modules' names. Idempotent."""
    rope_ref, rotate_ref = _rope_references()
    patched = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        namespace = vars(sys.modules[name]) if name in sys.modules else {}
        current = namespace.get("apply_rotary_pos_emb")
        if current is None or getattr(current, "_batchgen_original", None) is not None:
            continue
        if _same_code(current, rope_ref) and _same_code(namespace.get("rotate_half"), rotate_ref):
            sys.modules[name].apply_rotary_pos_emb = _make_rope(kernels, current)
            patched.append(name)
    if patched:
        log.debug("fused CPU rotary embedding in %s", ", ".join(patched))
    return patched


def _make_rope(kernels: PointwiseKernels, original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if current_metadata() is not None and unsqueeze_dim == 1 and rope_layout_ok(q, k, cos, sin):
            return kernels.rope(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._batchgen_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _make_norm_forward(kernels: PointwiseKernels, original):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _fast_path(hidden_states) or not self.weight.is_contiguous():
            return original(self, hidden_states)
        return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    return forward


def _make_mlp_forward(kernels: PointwiseKernels, original):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _fast_path(x):
            return original(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not (gate.is_contiguous() and up.is_contiguous()) and (rows_view(gate) is None or rows_view(up) is None):
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(kernels.silu_mul(gate, up))

    return forward
