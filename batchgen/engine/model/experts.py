"""Mixture-of-experts layers on the CPU in bf16: one grouped pass over the routed tokens, on expert
weights reordered once for oneDNN.

transformers 5 stores a MoE layer's experts as 3D parameters (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`, transposed in gpt-oss) in classes decorated with
`@use_experts_implementation`, whose forward dispatches on `config._experts_implementation`:
"eager" loops over the hit experts, finding each one's tokens with a one-hot mask and `where`;
"grouped_mm" (the default from_pretrained and from_config pick) sorts the (token, expert) pairs by
expert and runs `torch.nn.functional.grouped_mm` over the groups. On the CPU both end in one plain
matmul per expert and call, and in bf16 oneDNN reorders the weight into its blocked layout on
every such call (engine/model/prepack.py explains it for the dense linears).

The pass here is registered in transformers' ExpertsInterface as EXPERTS_IMPLEMENTATION and
selected with `model.set_experts_implementation`, so the model's own dispatch calls it. It sorts
the pairs by expert as grouped_mm does, runs each hit expert's gate/up and down matmuls on a copy
of its weights reordered once (`mkldnn._reorder_linear_weight`) at a bucketed row count (oneDNN
builds a kernel per row count), the gate (the class's own `_apply_gate`, or its activation) once
over all rows between them, and scatters the rows back weighted by the router. The copies cost
the experts' bytes once more, so they are made only where that fits prepack's memory share. A
class is switched only after its first module computed, on a handful of routed tokens, what its
eager forward computes (within rounding); any other module, call, dtype or device runs
transformers' grouped_mm as before. Each class's decision is logged once.
"""

from __future__ import annotations

import itertools
import logging

import torch

from batchgen.engine.memory import available_cpu_bytes
from batchgen.engine.model import prepack

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATION = "batchgen_grouped"
# where the pass runs by default: bf16. In float32 transformers' grouped_mm (MKL or oneDNN per group,
# no copy of the weights) kept pace with it in benchmarks/kernels/moe.py, so the copy would buy nothing;
# float16: oneDNN's reordered path is not tried at every row count (engine/model/prepack.py).
# The code is the same for every dtype: the float32 tests run it with float32 added here.
GROUPED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)
# the class check: this many tokens, and the largest difference from the eager forward it accepts,
# relative to the eager output's largest magnitude (matmuls summed in another order, per dtype)
CHECK_TOKENS = 16
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def bucket_rows(num_rows: int) -> int:
    """The row count an expert's matmul runs at: exact up to 16, else rounded up to a quarter of its
    power of two. oneDNN builds a kernel per row count, in bf16 a few matmuls' time each; the counts
    of a prefill's experts rarely repeat, the buckets do (4 per octave, under 25% padding)."""
    if num_rows <= 16:
        return num_rows
    step = 1 << (num_rows.bit_length() - 3)
    return -(-num_rows // step) * step


def _upstream():
    from transformers.integrations import moe

    return moe


def register() -> None:
    """Make EXPERTS_IMPLEMENTATION a name transformers' dispatch knows. Idempotent."""
    moe = _upstream()
    if EXPERTS_IMPLEMENTATION not in moe.ALL_EXPERTS_FUNCTIONS:
        moe.ExpertsInterface.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` built by transformers' `@use_experts_implementation` classes."""
    return [m for m in model.modules() if hasattr(m, "is_transposed") and hasattr(m, "has_gate")
            and hasattr(m, "down_proj") and isinstance(getattr(m, "num_experts", None), int)]


def _up_weight(module: torch.nn.Module) -> torch.Tensor:
    return module.gate_up_proj if module.has_gate else module.up_proj


def _as_linear(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """One expert's weight as F.linear takes it, [out_features, in_features], contiguous."""
    return (weight.t() if transposed else weight).contiguous()


def _plain(weight) -> bool:
    data = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    return type(data) is torch.Tensor and data.layout == torch.strided and data.is_floating_point()


def _pack(module: torch.nn.Module) -> None:
    with torch.no_grad():
        module._batchgen_packed_experts = tuple(
            [torch.ops.mkldnn._reorder_linear_weight(_as_linear(w[e].detach(), module.is_transposed),
                                                     prepack.PACK_ROWS_HINT) for e in range(module.num_experts)]
            for w in (_up_weight(module), module.down_proj))


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def grouped_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for each token: sum over its top-k experts of router weight x expert(token).
    hidden_states [num_tokens, hidden], top_k_index / top_k_weights [num_tokens, top_k]."""
    packed = getattr(self, "_batchgen_packed_experts", None)
    if packed is None or hidden_states.device.type != "cpu" or torch.is_grad_enabled() or not hidden_states.numel() \
            or hidden_states.dtype != self.down_proj.dtype or getattr(self, "_is_expert_parallel", False):
        return _upstream().grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    up_packed, down_packed = packed
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    down_bias = self.down_proj_bias if self.has_bias else None
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)  # [num_tokens * top_k]: the (token, expert) pairs, token-major
    order = torch.argsort(expert_ids, stable=True)  # the pairs grouped by expert
    counts = torch.bincount(expert_ids, minlength=self.num_experts)
    rows = hidden_states[order // top_k]  # [pairs, hidden], each expert's tokens contiguous
    # each expert's rows padded with zero rows to bucket_rows(count): slots[i] is sorted pair i's row
    padded = torch.tensor([bucket_rows(n) for n in counts.tolist()])
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    slots = torch.arange(rows.shape[0]) + shift[expert_ids[order]]
    padded_rows = rows.new_zeros(int(padded.sum()), hidden)  # [padded rows, hidden]
    padded_rows[slots] = rows
    rows, counts = padded_rows, padded.tolist()
    spans = [(expert, end - count, end)  # (expert, its first row, its row past the last) of the hit experts
             for expert, (count, end) in enumerate(zip(counts, itertools.accumulate(counts), strict=True)) if count]
    up = torch.cat([_linear(rows[a:b], up_packed[e], None if up_bias is None else up_bias[e]) for e, a, b in spans])
    # the gate is row-wise: one call over every expert's rows, not one per expert
    gated = self._apply_gate(up) if self.has_gate else self.act_fn(up)  # [rows, intermediate]
    out = torch.cat([_linear(gated[a:b], down_packed[e], None if down_bias is None else down_bias[e])
                     for e, a, b in spans])  # [rows, hidden]
    out = out[slots]  # [pairs, hidden]: the padding rows dropped
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    # in the router weights' dtype, as transformers' forwards multiply (float32 in Mixtral's bf16 model)
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    pairs = torch.empty_like(weighted)
    pairs[order] = weighted  # back to token-major: each token's top_k rows side by side
    # summed per token as grouped_mm sums them (not index_add_'s running sum in the output dtype)
    return pairs.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _matches_eager(module: torch.nn.Module, dtype: torch.dtype) -> tuple[bool, float]:
    """Whether the grouped pass computes what the class's eager forward does on CHECK_TOKENS random
    tokens routed to random experts; (ok, largest relative difference)."""
    generator = torch.Generator().manual_seed(0)
    hidden = module.down_proj.shape[-1] if module.is_transposed else module.down_proj.shape[1]
    x = torch.randn(CHECK_TOKENS, hidden, generator=generator).to(dtype)
    top_k = min(2, module.num_experts)
    scores = torch.rand(CHECK_TOKENS, module.num_experts, generator=generator)
    weights, index = torch.topk(scores, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    eager = type(module).forward.__wrapped__  # the class's own forward, under the dispatching wrapper
    with torch.no_grad():
        want = eager(module, x, index, weights).float()
        got = grouped_experts_forward(module, x, index, weights).float()
    scale = want.abs().max().clamp_min(1e-30)
    diff = float((got - want).abs().max() / scale)
    return diff <= CHECK_TOLERANCE[dtype], diff


def _why_not_grouped(model: torch.nn.Module, modules: list[torch.nn.Module], available_bytes: int | None) -> str | None:
    """Why no expert module of `model` can take the grouped pass here; None when they may."""
    param = next(model.parameters())
    if param.device.type != "cpu" or not prepack.supported(model):
        return f"{param.dtype} on {param.device.type}: no oneDNN-reordered weights here"
    if param.dtype not in GROUPED_DTYPES:
        return f"{param.dtype}: grouped_mm keeps pace there without a copy of the weights"
    if not hasattr(model, "set_experts_implementation"):
        return "the model has no set_experts_implementation"
    pending = [m for m in modules if getattr(m, "_batchgen_packed_experts", None) is None]
    extra = sum(w.numel() * w.element_size() for m in pending for w in (_up_weight(m), m.down_proj))
    available_bytes = available_cpu_bytes() if available_bytes is None else available_bytes
    if extra > prepack.MAX_EXTRA_MEMORY_SHARE * available_bytes:
        return (f"a reordered copy of the expert weights needs {extra / 2**20:.0f} MiB, more than "
                f"{100 * prepack.MAX_EXTRA_MEMORY_SHARE:.0f}% of the {available_bytes / 2**20:.0f} MiB available")
    return None


def group_experts(model: torch.nn.Module, available_bytes: int | None = None) -> int:
    """Run `model`'s MoE experts through the grouped pass where it applies; returns how many expert
    modules do. Idempotent: a second engine on the model reuses the reordered weights."""
    modules = expert_modules(model)
    if not modules:
        return 0
    why_not = _why_not_grouped(model, modules, available_bytes)
    if why_not is not None:
        log.debug("MoE experts: transformers' %s kept (%s)", model.config._experts_implementation, why_not)
        return 0
    register()
    dtype = next(model.parameters()).dtype
    decisions: dict[str, str] = {}  # expert class -> what was decided, logged once per model
    grouped = 0
    for module in modules:
        name = type(module).__name__
        if decisions.get(name, "").startswith("kept"):
            continue
        if not all(_plain(w) and w.dtype == dtype for w in (_up_weight(module), module.down_proj)):
            decisions.setdefault(name, "kept transformers' forward (expert weights quantized or not plain)")
            continue
        if getattr(module, "_batchgen_packed_experts", None) is None:
            _pack(module)
        if name not in decisions:
            ok, diff = _matches_eager(module, dtype)
            if not ok:
                del module._batchgen_packed_experts
                decisions[name] = f"kept transformers' forward (differs from its eager forward by {diff:.1e})"
                continue
            decisions[name] = "one grouped pass on reordered weights"
        grouped += 1
    if grouped:
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    log.debug("MoE experts: %d modules grouped: %s", grouped,
              "; ".join(f"{name} {what}" for name, what in sorted(decisions.items())))
    return grouped
