"""Fused CPU kernels for the pointwise chains of Llama-style models: RMSNorm, SiLU(gate) * up and
the rotary embedding.

In eager PyTorch these chains are many small ops, each a pass over the activations, a dispatch and
an OpenMP wake-up, which together make a real share of a small model's step. Each becomes one C call
(built like the decode kernel, engine/kernels/native.py).

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

import ctypes
import functools
import inspect
import logging
import sys
import types

import torch
import torch.nn.functional as F

from batchgen.engine.forward_context import current_metadata
from batchgen.engine.kernels import native
from batchgen.engine.kernels.fused_int8 import DTYPE_CODES as _DTYPE_CODES
from batchgen.engine.kernels.fused_int8 import Int8RowKernels

log = logging.getLogger(__name__)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class PointwiseKernels(Int8RowKernels):
    """ctypes bindings of csrc/pointwise.c (its int8 activation passes: engine/kernels/fused_int8.py)."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms = lib.rms_norm
        self._rms.argtypes = [_P, _P, _P, _I, _L, _L, ctypes.c_float, _I]
        self._rms.restype = None
        self._silu = lib.silu_mul
        self._silu.argtypes = [_P, _P, _P, _I, _L, _I]
        self._silu.restype = None
        self._silu_rows = lib.silu_mul_rows  # row-strided gate/up: halves of a stacked matmul's output
        self._silu_rows.argtypes = [_P, _P, _P, _I, _L, _L, _L, _L, _I]
        self._silu_rows.restype = None
        self._rope = lib.rope
        self._rope.argtypes = [_P, _P, _P, _P, _P, _P, _I, _L, _L, _L, _L, _I]
        self._rope.restype = None
        super().__init__(lib)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        assert x.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype
        out = torch.empty_like(x)
        cols = x.shape[-1]
        self._rms(x.data_ptr(), weight.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype], x.numel() // cols, cols,
                  float(eps), torch.get_num_threads())
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, contiguous; gate and up contiguous, or row-strided (rows_view)."""
        assert gate.shape == up.shape and gate.dtype == up.dtype
        out = torch.empty(gate.shape, dtype=gate.dtype)
        if gate.is_contiguous() and up.is_contiguous():
            self._silu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), _DTYPE_CODES[gate.dtype], gate.numel(),
                       torch.get_num_threads())
            return out
        g, u = rows_view(gate), rows_view(up)
        assert g is not None and u is not None
        self._silu_rows(g.data_ptr(), u.data_ptr(), out.data_ptr(), _DTYPE_CODES[gate.dtype], g.shape[0], g.shape[1],
                        g.stride(0), u.stride(0), torch.get_num_threads())
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, H, T, D], k [B, KVH, T, D] (token-major memory), cos/sin [B, T, D] -> rotated q, k."""
        assert _rope_layout_ok(q, k, cos, sin)
        B, H, T, D = q.shape
        q_out = torch.empty((B, T, H, D), dtype=q.dtype).transpose(1, 2)
        k_out = torch.empty((B, T, k.shape[1], D), dtype=k.dtype).transpose(1, 2)
        self._rope(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
                   _DTYPE_CODES[q.dtype], B * T, H, k.shape[1], D, torch.get_num_threads())
        return q_out, k_out


def rows_view(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with unit column stride and one row stride (a column slice of a wider
    contiguous tensor), or None when its memory is not laid out so."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # rows not evenly strided
        return None


def _token_major(x: torch.Tensor) -> bool:
    """[B, heads, T, D] viewed from [B, T, heads, D] contiguous memory (q_proj(...).view().transpose(1, 2))."""
    B, heads, T, D = x.shape
    return x.stride() == (T * heads * D, D, heads * D, 1) or (x.is_contiguous() and (heads == 1 or T == 1))


def _rope_layout_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    B, _, T, D = q.shape
    return (q.dtype in _DTYPE_CODES and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype
            and q.device.type == "cpu" and not torch.is_grad_enabled() and D % 2 == 0
            and k.shape[0] == B and k.shape[2] == T and k.shape[3] == D
            and cos.shape == (B, T, D) and sin.shape == (B, T, D) and cos.is_contiguous() and sin.is_contiguous()
            and _token_major(q) and _token_major(k))


def load() -> PointwiseKernels | None:
    lib = native.load_library(native.POINTWISE_SOURCE)
    return PointwiseKernels(lib) if lib is not None else None


@functools.cache
def load_cached() -> PointwiseKernels | None:
    """load(), once per process: for callers on the per-call path (engine/quant/int8.py)."""
    return load()


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
    return x.dtype in _DTYPE_CODES and x.device.type == "cpu" and x.is_contiguous() and not torch.is_grad_enabled()


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
    if param is None or param.device.type != "cpu" or param.dtype not in _DTYPE_CODES:
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
        if current_metadata() is not None and unsqueeze_dim == 1 and _rope_layout_ok(q, k, cos, sin):
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
