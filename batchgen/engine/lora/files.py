"""A PEFT LoRA adapter's files, read without torch or peft: its config checked, its content hashed.

A job checks its adapters and records their hashes before any model loads (a refusal costs no
load), and the engine reads the weights (engine/lora/adapter.py) through the same checks.

Only what the engine runs exactly as PEFT does is accepted: plain LoRA (no DoRA, no trained bias,
no modules_to_save, no per-module rank or alpha patterns) on the attention and MLP projections of
the Llama, Qwen, Mistral and Gemma families. Anything else is refused with the adapter's name and
the option, before any row runs, rather than run with a silently different output.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

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


def refuse(name: str, what: str) -> AdapterError:
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
        raise refuse(name, f"no {WEIGHTS_FILE} in {path} (a PEFT LoRA adapter directory holds it and {CONFIG_FILE})")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise refuse(name, f"no {CONFIG_FILE} in {path}") from None
    except (OSError, ValueError) as e:
        raise refuse(name, f"cannot read {file}: {e}") from None
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise refuse(name, f"peft_type {peft_type!r} is not supported (only LORA adapters)")
    for option, plain in _PLAIN_OPTIONS:
        value = config.get(option)
        if value not in plain:
            what = "DoRA (use_dora)" if option == "use_dora" else option
            raise refuse(name, f"{what}={value!r} is not supported (plain LoRA only)")
    targets = config.get("target_modules")
    if isinstance(targets, list | tuple):  # a string is a regex: the weights' names are checked below instead
        for target in targets:
            check_target(name, str(target).rsplit(".", 1)[-1], str(target))
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise refuse(name, f"rank r={rank!r} is not supported (1 to {MAX_RANK})")
    return config


def check_target(name: str, target: str, where: str) -> None:
    if target not in SUPPORTED_TARGETS:
        raise refuse(name, f"target module {target!r} ({where}) is not supported (target_modules may name "
                            f"{', '.join(sorted(SUPPORTED_TARGETS))})")


def adapter_hashes(adapters: dict[str, str]) -> dict[str, str]:
    """{name: content hash} of a job's adapters, each config checked first: what its fingerprint and
    its rows' prompt hashes record. Hashed once per process and file version (a job asks per row)."""
    out = {}
    for name, path in adapters.items():
        read_config(name, path)
        files = [Path(path) / f for f in (CONFIG_FILE, WEIGHTS_FILE)]
        out[name] = _cached_hash(str(path), tuple((f.stat().st_mtime_ns, f.stat().st_size) for f in files))
    return out


@functools.cache
def _cached_hash(path: str, versions: tuple) -> str:
    return content_hash(path)[:16]
