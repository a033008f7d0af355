"""Linear layers that add each row's LoRA update to the base output, in one packed forward.

A step packs the tokens of many rows, each with its own adapter (or none). A wrapped projection
runs its base forward (plain, prepacked or quantized: whatever the layer ran before) once over
all tokens, then, for each adapter present in the step, the low-rank update on that adapter's
tokens only: shrink (x @ A^T, to the rank) then expand (@ B^T, scaled). That is punica's SGMV
shape, one pair of small matmuls per adapter and layer, grouped by adapter; the base weights are
never merged per row, so rows of different adapters share every base matmul.

The step's grouping (which tokens belong to which adapter) is set by the model runner around the
forward, on this thread (`lora_step`), as the attention metadata is: Hugging Face's modules call
the projections with their inputs only.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from batchgen.engine.lora.adapter import AdapterError, LoraAdapter

_local = threading.local()


@dataclass(slots=True)
class AdapterRows:
    """One adapter's tokens in the step's packed [T] order: a slice when they are one run, else
    their indices (a gather before the shrink, an index_add after the expand)."""

    name: str
    rows: slice | torch.Tensor


def current_step() -> list[AdapterRows] | None:
    return getattr(_local, "groups", None)


@contextlib.contextmanager
def lora_step(groups: list[AdapterRows] | None) -> Iterator[None]:
    """Make the step's adapter groups visible to the wrapped layers for one forward on this thread."""
    assert current_step() is None, "LoRA steps do not nest"
    _local.groups = groups
    try:
        yield
    finally:
        _local.groups = None


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
            # stored transposed and scaled: x @ a_t @ b_t is the update, with no transposes per step
            a_t = a.t().contiguous().to(device=device, dtype=dtype)
            b_t = (b.t() * adapter.scaling).contiguous().to(device=device, dtype=dtype)
            per_module.setdefault(module_name, {})[name] = (a_t, b_t)
    num_bytes = dict.fromkeys(adapters, 0)
    for module_name, module in modules.items():
        pairs = per_module.get(module_name)
        if pairs is None:
            if getattr(module, "_batchgen_lora", None) is not None:
                module._batchgen_lora = {}  # an earlier engine's adapters
            continue
        # wrapped once; again where another engine's setup (prepack) has replaced the forward since
        if module.__dict__.get("forward") is not getattr(module, "_batchgen_lora_forward", None) \
                or "forward" not in module.__dict__:
            module.forward = types.MethodType(_make_forward(module.forward), module)
            module._batchgen_lora_forward = module.forward
        module._batchgen_lora = pairs
        for name, (a, b) in pairs.items():
            num_bytes[name] += a.numel() * a.element_size() + b.numel() * b.element_size()
    return num_bytes


def _make_forward(base_forward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = base_forward(x)
        groups = current_step()
        if not groups or not self._batchgen_lora:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        flat_out = out.view(-1, out.shape[-1])
        for group in groups:
            pair = self._batchgen_lora.get(group.name)
            if pair is None:  # this adapter leaves this layer alone
                continue
            a_t, b_t = pair
            xs = flat_x[group.rows]
            if xs.dtype != a_t.dtype:  # a quantized layer's float32 activations
                xs = xs.to(a_t.dtype)
            if isinstance(group.rows, slice) and out.dtype == b_t.dtype:
                flat_out[group.rows].addmm_(xs @ a_t, b_t)  # the expand and the add in one call
            else:
                flat_out.index_add_(0, _indices(group.rows, flat_out.device), ((xs @ a_t) @ b_t).to(out.dtype))
        return out

    return forward


def adapter_order(scheduled: list) -> list[int] | None:
    """The order to pack a step's rows in so that each adapter's tokens are one run (a slice in
    every wrapped layer, no gather or scatter); None when no row has an adapter, so a base-only
    step packs exactly as without LoRA. Stable: rows of one adapter keep the scheduler's order."""
    names = [s.seq.request.adapter for s in scheduled]
    if not any(names):
        return None
    return sorted(range(len(names)), key=lambda i: (names[i] is not None, names[i] or ""))


def _indices(rows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    return rows if isinstance(rows, torch.Tensor) else torch.arange(rows.start, rows.stop, device=device)


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
