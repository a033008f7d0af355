"""PEFT LoRA adapters for the tiny models of tests/tiny.py, made with peft itself (tests only: the
product reads the saved files without it). B is random, not PEFT's zeros, so each adapter changes
the model's output."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# name -> LoraConfig options: different ranks, targets and scalings, as the engine must mix them
ADAPTER_SPECS = {
    "attn4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all16": dict(r=16, lora_alpha=16, use_rslora=True,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp8": dict(r=8, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(model: torch.nn.Module, path: Path, seed: int, scale: float = 0.05, **options) -> Path:
    """Save a LoRA adapter of `model` (left unchanged) with random A and B to `path`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(str(path))
    return path


def make_adapters(model: torch.nn.Module, root: Path, specs: dict[str, dict] = ADAPTER_SPECS) -> dict[str, str]:
    return {name: str(make_adapter(model, root / name, seed=i + 1, **options))
            for i, (name, options) in enumerate(specs.items())}


def peft_model(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """`model` (a copy) with the adapter at `path` loaded by peft: the reference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), path).eval()
