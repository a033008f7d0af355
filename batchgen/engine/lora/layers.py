"""Linear layers that add each row's LoRA update to the base output, in one packed forward.

A step packs the tokens of many rows, each with its own adapter (or none). A wrapped projection
runs its base forward (plain, prepacked or quantized: whatever the layer ran before) once over
all tokens, then the adapters' low-rank updates: shrink (x @ A^T, to the rank) then expand
(@ B^T, scaled) and add. The base weights are never merged per row, so rows of different adapters
share every base matmul.

Each projection holds its adapters stacked along the rank (one A of [sum of ranks, in], one B^T of
[sum of ranks, out]). A decode step's rows are a few tokens per adapter, where a matmul's cost is
its call, not its arithmetic: there every adapter of the step runs in one shrink over the stack,
a mask that keeps each token's own adapter's columns (zero for the others and for base rows),
and one expand-and-add (the punica BGMV idea, as two dense calls). A step of many adapter tokens
(prefill chunks) runs each adapter's pair on its own slice instead (punica's SGMV shape), where
the stack's extra arithmetic would cost more than the calls it saves.

The step's grouping (which tokens belong to which adapter) is set by the model runner around the
forward, on this thread (`lora_step`), as the attention metadata is: Hugging Face's modules call
the projections with their inputs only.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.engine.lora.adapter import AdapterError, LoraAdapter

# a step with at most this many adapter tokens applies all its adapters in one masked pass over
# the stack; above it each adapter runs on its own slice (benchmarks/peers/lora_mix.py's decode steps are
# below it, a prefill chunk above it)
STACKED_MAX_TOKENS = 256

_local = threading.local()


@dataclass(slots=True)
class AdapterRows:
    """One adapter's tokens in the step's packed [T] order: a slice when they are one run, else
    their indices (a gather before the shrink, an index_add after the expand)."""

    name: str
    rows: slice | torch.Tensor


@dataclass(slots=True)
class LayerAdapters:
    """The adapters of one projection, stacked along the rank: rows `ranks[name]` of `a` are that
    adapter's A, the same rows of `b` its B^T times its scaling."""

    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [sum of ranks, out]
    ranks: dict[str, slice]
    key: tuple  # which adapters at which rows: layers with the same key share a step's mask


@dataclass(slots=True)
class LoraStep:
    """A step's adapter groups, and the masks its stacked passes use (built once per step for each
    set of adapters a layer holds)."""

    groups: list[AdapterRows]
    stacked: bool  # all groups are slices and few tokens: one masked pass per layer
    masks: dict[tuple, tuple[slice, torch.Tensor]] = field(default_factory=dict)

    def mask(self, layer: LayerAdapters, present: list[AdapterRows]) -> tuple[slice, torch.Tensor]:
        """The tokens from the first to the last of `present`'s, and which of the stack's columns
        each of them keeps: 1 for its own adapter's, 0 for the rest (base rows and rows of adapters
        this layer lacks keep none)."""
        cached = self.masks.get(layer.key)
        if cached is None:
            first, last = min(g.rows.start for g in present), max(g.rows.stop for g in present)
            mask = torch.zeros(last - first, layer.a.shape[0], dtype=layer.a.dtype, device=layer.a.device)
            for g in present:
                mask[g.rows.start - first:g.rows.stop - first, layer.ranks[g.name]] = 1
            cached = self.masks[layer.key] = (slice(first, last), mask)
        return cached


def current_step() -> LoraStep | None:
    return getattr(_local, "step", None)


@contextlib.contextmanager
def lora_step(groups: list[AdapterRows] | None) -> Iterator[None]:
    """Make the step's adapter groups visible to the wrapped layers for one forward on this thread."""
    assert current_step() is None, "LoRA steps do not nest"
    if groups:
        slices = all(isinstance(g.rows, slice) for g in groups)
        tokens = sum(g.rows.stop - g.rows.start if isinstance(g.rows, slice) else len(g.rows) for g in groups)
        _local.step = LoraStep(groups, stacked=slices and len(groups) > 1 and tokens <= STACKED_MAX_TOKENS)
    try:
        yield
    finally:
        _local.step = None


def attach(model: torch.nn.Module, adapters: dict[str, LoraAdapter]) -> dict[str, int]:
    """Wrap every projection some adapter targets; returns the bytes each adapter holds on the
    model's device. Checks that each adapter fits the model (its modules exist, its shapes match)
    before changing anything. Calling it again (another engine on the same model) replaces the set."""
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    per_module: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, adapter in adapters.items():
        for module_name, (a, b) in adapter.weights.items():
            module = modules.get(module_name)
            if module is None:
                raise AdapterError(f"--lora {name}: the model has no module {module_name} (an adapter for another "
                                   "base model?)")
            in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
            if in_features is None or out_features is None:
                raise AdapterError(f"--lora {name}: {module_name} is a {type(module).__name__}, not a linear layer "
                                   "LoRA can wrap (with --quantize int4, run the base model unquantized or int8)")
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise AdapterError(f"--lora {name}: {module_name} is {in_features} -> {out_features} in the model, "
                                   f"the adapter's is {a.shape[1]} -> {b.shape[0]} (an adapter for another base "
                                   "model?)")
            # B stored transposed and scaled: the expand is one addmm with no transpose per step
            per_module.setdefault(module_name, {})[name] = (a, b.t() * adapter.scaling)
    num_bytes = dict.fromkeys(adapters, 0)
    for module_name, module in modules.items():
        pairs = per_module.get(module_name)
        if pairs is None:
            if getattr(module, "_batchgen_lora", None) is not None:
                module._batchgen_lora = None  # an earlier engine's adapters
            continue
        # wrapped once; again where another engine's setup (prepack) has replaced the forward since
        if module.__dict__.get("forward") is not getattr(module, "_batchgen_lora_forward", None) \
                or "forward" not in module.__dict__:
            module.forward = types.MethodType(_make_forward(module.forward), module)
            module._batchgen_lora_forward = module.forward
        module._batchgen_lora = _stack(pairs, device, dtype)
        for name, (a, b) in pairs.items():
            num_bytes[name] += (a.numel() + b.numel()) * dtype.itemsize
    return num_bytes


def _stack(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], device: torch.device,
           dtype: torch.dtype) -> LayerAdapters:
    ranks, start = {}, 0
    for name, (a, _) in pairs.items():
        ranks[name] = slice(start, start + a.shape[0])
        start += a.shape[0]
    a = torch.cat([a for a, _ in pairs.values()]).to(device=device, dtype=dtype).contiguous()
    b = torch.cat([b for _, b in pairs.values()]).to(device=device, dtype=dtype).contiguous()
    return LayerAdapters(a, b, ranks, key=tuple((name, r.start, r.stop) for name, r in ranks.items()))


def _make_forward(base_forward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = base_forward(x)
        step, layer = current_step(), self._batchgen_lora
        if step is None or layer is None:
            return out
        present = [g for g in step.groups if g.name in layer.ranks]  # adapters that change this layer
        if not present:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        flat_out = out.view(-1, out.shape[-1])
        if step.stacked and len(present) > 1:
            span, mask = step.mask(layer, present)
            _add_update(flat_x, flat_out, span, layer.a, layer.b, mask)
        else:
            for group in present:
                ranks = layer.ranks[group.name]
                _add_update(flat_x, flat_out, group.rows, layer.a[ranks], layer.b[ranks], None)
        return out

    return forward


def _add_update(flat_x: torch.Tensor, flat_out: torch.Tensor, rows: slice | torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, mask: torch.Tensor | None) -> None:
    """flat_out[rows] += ((x[rows] @ A^T) * mask) @ B^T: one shrink, the mask, one expand-and-add."""
    xs = flat_x[rows]
    if xs.dtype != a.dtype:  # a quantized layer's float32 activations
        xs = xs.to(a.dtype)
    h = F.linear(xs, a)
    if mask is not None:
        h.mul_(mask)
    if isinstance(rows, slice) and flat_out.dtype == b.dtype:
        flat_out[rows].addmm_(h, b)  # the expand and the add in one call
    elif isinstance(rows, slice):
        flat_out[rows] += (h @ b).to(flat_out.dtype)
    else:
        flat_out.index_add_(0, rows, (h @ b).to(flat_out.dtype))


def adapter_order(scheduled: list) -> list[int] | None:
    """The order to pack a step's rows in so that each adapter's tokens are one run (a slice in
    every wrapped layer, no gather or scatter); None when no row has an adapter, so a base-only
    step packs exactly as without LoRA. Stable: rows of one adapter keep the scheduler's order."""
    names = [s.seq.request.adapter for s in scheduled]
    if not any(names):
        return None
    return sorted(range(len(names)), key=lambda i: (names[i] is not None, names[i] or ""))


def step_groups(spans: list[tuple[str | None, int, int]], device: torch.device) -> list[AdapterRows] | None:
    """The step's adapter groups from each scheduled row's (adapter, first token, token count) in
    packed order; None when no row has an adapter (the wrapped layers then run their base alone)."""
    runs: dict[str, list[tuple[int, int]]] = {}
    for name, start, n in spans:
        if name is None or n == 0:
            continue
        ranges = runs.setdefault(name, [])
        if ranges and ranges[-1][1] == start:  # adjacent rows of one adapter: one run
            ranges[-1] = (ranges[-1][0], start + n)
        else:
            ranges.append((start, start + n))
    if not runs:
        return None
    groups = []
    for name, ranges in runs.items():
        if len(ranges) == 1:
            groups.append(AdapterRows(name, slice(*ranges[0])))
        else:
            index = [i for start, end in ranges for i in range(start, end)]
            pinned = device.type == "cuda"
            rows = torch.tensor(index, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=pinned)
            groups.append(AdapterRows(name, rows))
    return groups
