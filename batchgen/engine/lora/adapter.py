"""A PEFT LoRA adapter read from its directory (adapter_config.json + adapter_model.safetensors),
without peft: the file format is small and stable, and a batch job should not need PEFT installed.

Only what the engine runs exactly as PEFT does is accepted: plain LoRA (no DoRA, no trained bias,
no modules_to_save, no per-module rank or alpha patterns) on the attention and MLP projections of
the Llama, Qwen, Mistral and Gemma families. Anything else is refused with the adapter's name and
the option, before any row runs, rather than run with a silently different output.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_RANK = 64
# the projections PEFT targets in these families, by their module's last name
SUPPORTED_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# PEFT writes keys under the PeftModel's wrapper: "base_model.model." + the base model's module name
KEY_PREFIX = "base_model.model."
# config options that change what LoRA computes and have a "plain LoRA" value: (option, plain values)
_PLAIN_OPTIONS = (
    ("use_dora", (False, None)),
    ("modules_to_save", (None, [], ())),
    ("bias", ("none", None)),
    ("lora_bias", (False, None)),
    ("fan_in_fan_out", (False, None)),
    ("rank_pattern", ({}, None)),
    ("alpha_pattern", ({}, None)),
    ("target_parameters", (None, [], ())),
    ("layer_replication", (None, [], ())),
    ("use_qalora", (False, None)),
    ("trainable_token_indices", (None, {}, [])),
)


class AdapterError(ConfigError):
    """A LoRA adapter cannot be loaded or does not fit the model (exit 2, before the job starts)."""


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    content_hash: str  # sha256 over the config and weights files: a changed adapter is another adapter
    # module name in the base model (e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _refuse(name: str, what: str) -> AdapterError:
    return AdapterError(f"--lora {name}: {what}")


def content_hash(path: str | Path) -> str:
    """The adapter's identity: its two files' bytes (cheap next to loading them, and what a job's
    fingerprint compares when it resumes)."""
    h = hashlib.sha256()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        with open(Path(path) / file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):  # noqa: B023 (f is this loop's file)
                h.update(chunk)
    return h.hexdigest()


def read_config(name: str, path: str | Path) -> dict:
    """adapter_config.json, checked for options the engine does not run as PEFT does."""
    file = Path(path) / CONFIG_FILE
    if not (Path(path) / WEIGHTS_FILE).is_file():
        raise _refuse(name, f"no {WEIGHTS_FILE} in {path} (a PEFT LoRA adapter directory holds it and {CONFIG_FILE})")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise _refuse(name, f"no {CONFIG_FILE} in {path}") from None
    except (OSError, ValueError) as e:
        raise _refuse(name, f"cannot read {file}: {e}") from None
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _refuse(name, f"peft_type {peft_type!r} is not supported (only LORA adapters)")
    for option, plain in _PLAIN_OPTIONS:
        value = config.get(option)
        if value not in plain:
            what = "DoRA (use_dora)" if option == "use_dora" else option
            raise _refuse(name, f"{what}={value!r} is not supported (plain LoRA only)")
    targets = config.get("target_modules")
    if isinstance(targets, list | tuple):  # a string is a regex: the weights' names are checked below instead
        for target in targets:
            _check_target(name, str(target).rsplit(".", 1)[-1], str(target))
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise _refuse(name, f"rank r={rank!r} is not supported (1 to {MAX_RANK})")
    return config


def _check_target(name: str, target: str, where: str) -> None:
    if target not in SUPPORTED_TARGETS:
        raise _refuse(name, f"target module {target!r} ({where}) is not supported (target_modules may name "
                            f"{', '.join(sorted(SUPPORTED_TARGETS))})")


def read_adapter(name: str, path: str | Path, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """The adapter's LoRA pairs by the base model's module names, in `dtype`, on the CPU."""
    from safetensors.torch import load_file

    config = read_config(name, path)
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for a damaged file)
        raise _refuse(name, f"cannot read {Path(path) / WEIGHTS_FILE}: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, sep, part = key.removeprefix(KEY_PREFIX).rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise _refuse(name, f"weight {key!r} is not a LoRA A/B matrix (embeddings, biases and saved modules are "
                                "not supported)")
        _check_target(name, module.rsplit(".", 1)[-1], module)
        pairs.setdefault(module, {})[part[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise _refuse(name, f"{module} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(name, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have rank "
                                f"r={rank}")
        weights[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not weights:
        raise _refuse(name, f"{path} holds no LoRA weights")
    return LoraAdapter(name=name, path=str(path), rank=rank, scaling=scaling, content_hash=content_hash(path),
                       weights=weights)
