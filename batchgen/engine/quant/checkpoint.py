"""What a checkpoint says of its own quantization: a pre-quantized config's method (run, or refused
by name) and the scheme nearest a quantized GGUF's. engine/quant/plan.py and engine/quant/quantize.py
act on it at load."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

# pre-quantized checkpoints whose quantized linear layers run under our forward (tensor subclasses
# or module swaps on CPU and CUDA); others (GPTQ, AWQ, bitsandbytes, ...) need CUDA kernel packages
# and are refused by name
PREQUANTIZED_METHODS = ("torchao", "quanto")


def checkpoint_quantization(model: torch.nn.Module) -> str | None:
    """The quant_method of a pre-quantized checkpoint's config, else None."""
    qc = getattr(model.config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def check_config_quantization(model_dir: str, name: str) -> None:
    """Refuse, before transformers loads anything, a local checkpoint whose config.json names a
    quantization method we cannot run: transformers would otherwise fail first with its own import
    error ("No module named 'optimum.gptq'", "requires gptqmodel") that does not name the method."""
    import json

    try:
        qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return  # no readable config: from_pretrained reports it
    if isinstance(qc, dict) and qc.get("quant_method") is not None:
        check_prequantized(str(qc["quant_method"]), name)


def check_prequantized(method: str, name: str) -> None:
    from batchgen.errors import UnsupportedModelError

    if method not in PREQUANTIZED_METHODS:
        raise UnsupportedModelError(f"model {name!r} is pre-quantized with {method!r}, which batchgen's forward "
                                    f"cannot run; supported: {', '.join(PREQUANTIZED_METHODS)} (or a full-precision "
                                    f"checkpoint with --quantize)")


@functools.cache
def gguf_scheme(gguf_path) -> str:
    """The supported scheme nearest a GGUF's own: Q2..Q4 -> int4, Q5..Q8 -> int8-weight, floats -> none.

    From the file name's quant tag (llama.cpp's convention, "…Q4_1.gguf") when it has one: reading
    the header with gguf's reader parses every tensor (~3 s for a 100 MB file); else the reader."""
    tags = re.findall(r"(?:^|[._-])I?(Q\d)", Path(str(gguf_path)).name.upper())
    if tags:
        types = tags
    else:
        try:
            from gguf import GGUFReader
            types = [t.tensor_type.name.upper().removeprefix("I") for t in GGUFReader(str(gguf_path)).tensors
                     if len(t.shape) == 2]
        except Exception:
            return "none"
    quantized = [t for t in types if t.startswith("Q")]
    if not quantized:
        return "none"
    most = max(set(quantized), key=quantized.count)
    return "int4" if most[1:2] in ("1", "2", "3", "4") else "int8-weight"
