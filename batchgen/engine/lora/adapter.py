"""A PEFT LoRA adapter's weights, by the base model's module names (engine/lora/files.py reads
and checks its config)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen.engine.lora.files import (
    KEY_PREFIX,
    WEIGHTS_FILE,
    AdapterError,
    check_target,
    content_hash,
    read_config,
    refuse,
)

__all__ = ["AdapterError", "LoraAdapter", "read_adapter"]


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    content_hash: str  # sha256 over the config and weights files: a changed adapter is another adapter
    # module name in the base model (e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    # what its wrapped layers hold on the model's device once attached (engine/lora/layers.py); its
    # `weights` are then dropped, so the adapter is held once
    device_bytes: int = 0
    num_layers: int = 0  # projections it changes


def read_adapter(name: str, path: str | Path, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """The adapter's LoRA pairs by the base model's module names, in `dtype`, on the CPU."""
    from safetensors.torch import load_file

    config = read_config(name, path)
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for a damaged file)
        raise refuse(name, f"cannot read {Path(path) / WEIGHTS_FILE}: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, sep, part = key.removeprefix(KEY_PREFIX).rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise refuse(name, f"weight {key!r} is not a LoRA A/B matrix (embeddings, biases and saved modules are "
                                "not supported)")
        check_target(name, module.rsplit(".", 1)[-1], module)
        pairs.setdefault(module, {})[part[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise refuse(name, f"{module} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise refuse(name, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have rank "
                                f"r={rank}")
        weights[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not weights:
        raise refuse(name, f"{path} holds no LoRA weights")
    return LoraAdapter(name=name, path=str(path), rank=rank, scaling=scaling, content_hash=content_hash(path),
                       weights=weights, num_layers=len(weights))
