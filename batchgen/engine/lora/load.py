"""An engine's LoRA adapters: read once from their directories, checked against the model, held
on its device for the engine's life (every step may mix them)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from batchgen.engine.lora.adapter import AdapterError, LoraAdapter, read_adapter
from batchgen.engine.lora.layers import attach

if TYPE_CHECKING:
    from batchgen.engine.engine_config import EngineConfig

log = logging.getLogger(__name__)


def load(model: torch.nn.Module, config: EngineConfig) -> dict[str, LoraAdapter]:
    """The adapters of `config.lora_adapters`, wrapped into `model`'s projections ({} when none).

    With adapters, the compiled forward is refused, and the engine captures no CUDA graphs: each
    step's grouping by adapter is Python that a graph would bake in (or break on)."""
    dirs = config.lora_adapters or {}
    if not dirs:
        if any(getattr(m, "_batchgen_lora", None) for m in model.modules()):
            attach(model, {})  # an earlier engine's adapters on this model
        return {}
    if config.compile:
        raise AdapterError("--lora runs on the eager forward; drop --compile")
    dtype = next(model.parameters()).dtype
    adapters = {name: read_adapter(name, path, dtype if dtype.is_floating_point else torch.float32)
                for name, path in dirs.items()}
    for name, num_bytes in attach(model, adapters).items():
        adapters[name].device_bytes = num_bytes
    log.info("LoRA: %d adapters (%s), %.1f MiB on %s; CUDA graphs off", len(adapters),
             ", ".join(f"{a.name} r={a.rank} on {a.num_layers} layers" for a in adapters.values()),
             sum(a.device_bytes for a in adapters.values()) / 2**20, next(model.parameters()).device)
    for adapter in adapters.values():
        adapter.weights = {}  # the wrapped layers hold their own copies
    return adapters
