"""A GGUF file's model config from its metadata alone, read before any conversion.

Converting a GGUF to safetensors (engine/model/loader.py) dequantizes every tensor and can take
minutes; a model the engine would refuse must be refused before that. The `gguf` package's
GGUFReader parses every metadata array on open (a tokenizer's ~100k strings: seconds); this
reader keeps scalars and short numeric arrays and seeks past the rest, then maps the keys to a
transformers config the way transformers' own GGUF loader does (GGUF_CONFIG_MAPPING).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from batchgen.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GGUF_MAGIC = b"GGUF"
MAX_KEPT_ARRAY_LEN = 4096  # numeric arrays up to this long are kept (per-layer head counts); longer ones skipped
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path) -> dict:
    """The GGUF header's key-value pairs: scalars, strings and short numeric arrays (others skipped)."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UnsupportedModelError(f"{path.name} is not a GGUF file (no GGUF magic)")
        version, _tensor_count, kv_count = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise UnsupportedModelError(f"{path.name} is GGUF version {version}; transformers reads version 2 or later")
        out = {}
        for _ in range(kv_count):
            key = _string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            out[key] = _value(f, value_type)
        return {k: v for k, v in out.items() if v is not _SKIPPED}


_SKIPPED = object()


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, value_type: int):
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if value_type == _STRING:
        return _string(f)
    if value_type != _ARRAY:
        raise UnsupportedModelError(f"unknown GGUF metadata value type {value_type}")
    elem_type, count = struct.unpack("<IQ", f.read(12))
    if elem_type in _SCALARS:
        size = struct.calcsize(_SCALARS[elem_type])
        if count > MAX_KEPT_ARRAY_LEN:
            f.seek(size * count, 1)
            return _SKIPPED
        return list(struct.unpack(f"<{count}{_SCALARS[elem_type][1]}", f.read(size * count)))
    for _ in range(count):  # strings (the tokenizer's vocabulary and merges) or nested arrays: skipped
        if elem_type == _STRING:
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(n, 1)
        else:
            _value(f, elem_type)
    return _SKIPPED


def model_type_of(metadata: dict) -> str:
    """transformers' model_type for the file's `general.architecture`, renamed as its GGUF loader does."""
    arch = str(metadata.get("general.architecture", ""))
    name = str(metadata.get("general.name", "")).lower()
    if "llama" in arch and "mistral" in name:
        return "mistral"
    renames = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
    return renames.get(arch, arch)


def config_from_gguf(path: Path) -> PretrainedConfig | None:
    """The transformers config the conversion would build, from the metadata alone. Refuses an
    architecture transformers cannot convert; None where the config cannot be built here (the
    conversion then reports why)."""
    from transformers import AutoConfig  # here: read_metadata serves the checks that run before transformers loads
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    metadata = read_metadata(path)
    arch = str(metadata.get("general.architecture", ""))
    model_type = model_type_of(metadata)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and model_type not in GGUF_SUPPORTED_ARCHITECTURES:
        readable = ", ".join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}))
        raise UnsupportedModelError(f"{path.name}: GGUF architecture {arch!r} is one transformers cannot convert "
                                    f"(it reads {readable})")
    mapping = GGUF_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING.get(arch) or {}
    values = {}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        if prefix in (arch, model_type) and mapping.get(rest):
            values[mapping[rest]] = value
    if isinstance(values.get("num_key_value_heads"), list):  # per-layer counts (LFM2): transformers takes the max
        values["num_key_value_heads"] = max(values["num_key_value_heads"])
    model_type = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(model_type, model_type)
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError, TypeError):
        return None
