"""What `--quantize`, `--quantize-backend` and `--quantize-embedding` resolve to, before any weight
is touched: the `Quantization` a model will get (its label goes into the job fingerprint), the
backend `auto` picks per device and scheme, the refusals of flag combinations that cannot run, and
the scheme nearest a quantized GGUF's. engine/quant/quantize.py applies the result to a model.

Which backend runs fastest per device and scheme comes from benchmarks/quant/quantization.py (the
reasons per scheme: docs/quantization.md); `auto` encodes that table in AUTO_BACKEND.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from batchgen.engine.quant.checkpoint import gguf_scheme
from batchgen.engine.quant.embedding import EMBEDDING_SCHEMES
from batchgen.errors import ConfigError

log = logging.getLogger(__name__)

SCHEMES = ("none", "int8", "int8-weight", "int4")
BACKENDS = ("auto", "torchao", "quanto", "onednn")
# (device type, scheme) -> backend, from benchmarks/quant/quantization.py on this project's CPUs (see
# docs/quantization.md): for int8 (dynamic int8 activations), oneDNN where the CPU has VNNI or AMX
# (resolve_backend; its int8 matmul beat bf16 there while torchao's eager _int_mm lost), else torchao;
# for int8 weights quanto's CPU kernel (aten's int8-weight GEMM) beats torchao's per-call upcast;
# for int4 torchao's packed CPU kernel beats quanto's unpack-and-matmul.
AUTO_BACKEND = {
    ("cpu", "int8"): "torchao",
    ("cpu", "int8-weight"): "quanto",
    ("cpu", "int4"): "torchao",
    ("cuda", "int8"): "torchao",
    ("cuda", "int8-weight"): "quanto",
    ("cuda", "int4"): "torchao",
}
# --quantize-embedding auto: which schemes also quantize the embedding/LM head to int8
EMBEDDING_AUTO = {"int4": "int8"}
_PACKAGES = {"torchao": "torchao", "quanto": "optimum.quanto"}
_PIP_NAMES = {"torchao": "torchao", "quanto": "optimum-quanto"}


@dataclass(frozen=True, slots=True)
class Quantization:
    scheme: str  # one of SCHEMES
    backend: str | None  # torchao | quanto; None for "none" or a pre-quantized checkpoint's own method
    embedding: str = "none"  # none | int8: the embedding/LM head (engine/quant/embedding.py)
    # int8/onednn: its recipe's calibration pass ran (outlier channels: engine/quant/int8_model.py);
    # an int8/onednn model without it is plain per-token int8
    calibrated_run: bool = False

    @property
    def label(self) -> str:
        label = self.scheme if self.backend is None else f"{self.scheme}/{self.backend}"
        label += "+calibrated" if self.calibrated_run else ""
        return label if self.embedding == "none" else f"{label}+{self.embedding}-embedding"

    @property
    def calibrated(self) -> bool:
        """Whether this scheme calibrates (int8/onednn: its outlier channels), so needs the
        full-precision model to run calibration text before its linear layers are swapped (not the
        streaming loader)."""
        return self.scheme == "int8" and self.backend == "onednn"


def plan_quantization(config, scheme: str, backend: str, embedding: str, device: torch.device) -> Quantization:
    """What quantize_model will apply, checked before any weight is touched (ConfigError otherwise)."""
    resolved = resolve_backend(scheme, backend, device)
    emb = resolve_embedding(embedding, scheme)
    if resolved is not None and getattr(config, "quantization_config", None):
        raise ConfigError("this model is already quantized (its config has a quantization_config); "
                          "use --quantize none (or auto) with a pre-quantized checkpoint")
    return Quantization("none" if resolved is None else scheme, resolved, emb)


def resolve_embedding(embedding: str, scheme: str) -> str:
    """none | int8 for the embedding/LM head under `scheme`; ConfigError for an unknown value."""
    if embedding not in EMBEDDING_SCHEMES:
        raise ConfigError(f"quantize_embedding must be one of {', '.join(EMBEDDING_SCHEMES)}; got {embedding!r}")
    if embedding == "auto":
        return EMBEDDING_AUTO.get(scheme, "none")
    return embedding


def resolve_backend(scheme: str, backend: str, device: torch.device) -> str | None:
    """The backend that will run `scheme` on `device`; ConfigError when it cannot."""
    if scheme not in SCHEMES:
        raise ConfigError(f"quantize must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"quantize_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if scheme == "none":
        return None
    if backend == "auto":
        backend = AUTO_BACKEND.get((device.type, scheme), "torchao")
        if (device.type, scheme) == ("cpu", "int8"):
            from batchgen.engine.quant import int8 as quantize_int8

            backend = "onednn" if quantize_int8.cpu_has_int8_matmul() and quantize_int8.supported("cpu") else backend
    if backend == "onednn" and (scheme != "int8" or device.type != "cpu"):
        raise ConfigError(f"quantize_backend onednn runs --quantize int8 on CPU only (its int8 x int8 matmul); "
                          f"got --quantize {scheme} on {device.type}")
    if backend == "onednn":
        from batchgen.engine.quant import int8 as quantize_int8

        if not quantize_int8.supported(device.type):
            raise ConfigError("quantize_backend onednn needs torch's oneDNN quantized ops and batchgen's C kernels "
                              "(a C compiler); use --quantize-backend torchao")
        return backend
    if backend == "quanto" and scheme == "int8":
        raise ConfigError("quantize int8 (dynamic int8 activations) runs on torchao only: quanto quantizes "
                          "activations statically, after calibration; use --quantize-backend torchao, or "
                          "--quantize int8-weight for quanto")
    if importlib.util.find_spec(_PACKAGES[backend].split(".")[0]) is None or (
            backend == "quanto" and importlib.util.find_spec("optimum.quanto") is None):
        raise ConfigError(f"quantize {scheme} with {backend} needs the {_PIP_NAMES[backend]} package: "
                          f"pip install 'batchgen[quant]'")
    return backend


def requested_scheme(scheme: str, name: str, gguf_path=None) -> str:
    """--quantize with `auto` resolved: a quantized GGUF's nearest scheme, else none."""
    if scheme == "auto":
        scheme = gguf_scheme(gguf_path) if gguf_path is not None else "none"
        if gguf_path is not None:
            log.info("%s: its GGUF quantization maps to --quantize %s", name, scheme)
    elif gguf_path is not None and scheme == "none" and gguf_scheme(gguf_path) != "none":
        log.info("%s: its quantized GGUF weights run dequantized to full precision (--quantize auto would map "
                 "them to %s)", name, gguf_scheme(gguf_path))
    return scheme
