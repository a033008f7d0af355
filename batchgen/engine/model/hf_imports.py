"""Keep transformers from importing torchao in a job that does not quantize with it.

transformers imports every quantizer when its model code loads (modeling_utils ->
quantizers.auto), and its torchao quantizer imports torchao whenever the package is installed.
torchao's import registers its enums with torch's pytree, which current torch answers with a
deprecation warning per enum: two log lines in every run, --quantize none included, and seconds
of imports for nothing. A job that needs torchao neither for its own quantization
(engine/quant/quantize.py imports it itself) nor for a torchao pre-quantized checkpoint tells
transformers, before transformers decides, that torchao is not available.

Only before transformers' quantizers are imported (a fresh `batchgen` process): once they are,
the decision is made and this leaves it alone (so in-process callers and tests are unaffected).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.config.job import JobConfig

_DECIDED = ("torchao", "transformers.quantizers.quantizer_torchao")


def needs_torchao(config: JobConfig) -> bool:
    """Whether the job may load torchao: any quantization asked for, or a checkpoint that may be
    torchao pre-quantized (a local one that says so; a hub id, which cannot be read yet)."""
    if config.quantize != "none" or config.quantize_embedding not in ("none", "auto"):
        return True
    model = config.model
    if model is None or model.endswith(".gguf"):  # the embedded default and GGUF files: dequantized dense models
        return False
    local = Path(model).expanduser()
    if not local.is_dir():
        return True  # a hub id: its config is not read until transformers loads it
    try:
        qc = json.loads((local / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False  # no readable config: the load reports it
    return isinstance(qc, dict) and qc.get("quant_method") == "torchao"


def keep_torchao_out(config: JobConfig) -> bool:
    """Before transformers loads its quantizers: make its torchao check say no for this process,
    unless the job needs torchao. True when it did."""
    if needs_torchao(config) or any(name in sys.modules for name in _DECIDED):
        return False
    import transformers.utils  # light: the model code (and its quantizers) loads later, lazily
    import transformers.utils.import_utils as import_utils

    def unavailable(*args, **kwargs) -> bool:
        return False

    # quantizer_torchao reads the name from transformers.utils when it is imported; both spellings
    transformers.utils.is_torchao_available = unavailable
    import_utils.is_torchao_available = unavailable
    return True
