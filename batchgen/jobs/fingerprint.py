"""The job fingerprint: every setting that changes what a row's output is.

A run whose fingerprint differs from the one the output directory was begun with is refused
(exit 2, naming what changed) unless --overwrite; with no committed rows yet there is nothing to
protect and the new run simply begins again (batchgen.jobs.session).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen import __version__
from batchgen.config import JobConfig
from batchgen.io.manifest import fingerprint_digest
from batchgen.jobs.rows import RowSource

# Set after the model is loaded; compared only then. The dtype is the resolved one ("auto" may
# mean bfloat16 on one machine and float32 on another): greedy outputs differ between them.
MODEL_KEYS = ("model_revision", "dtype", "chat", "max_context_tokens")
# Shown but never compared: the same model may be named by another path on a resume.
INFO_KEYS = ("model",)


def job_fingerprint(config: JobConfig, source: RowSource, schema: pa.Schema, *, model: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Settings that decide a row's output. `model` (from the loaded model and the prompt
    builder: MODEL_KEYS plus "model") is left out for the check made before loading."""
    fingerprint = {
        "batchgen_version": __version__,
        "model": config.model,
        "prompt_column": config.prompt_column, "template": config.template, "system": config.system,
        "id_column": config.id_column, "max_new_tokens": config.max_new_tokens,
        "max_new_tokens_column": config.max_new_tokens_column, "temperature": config.temperature,
        "top_p": config.top_p, "top_k": config.top_k, "seed": config.seed, "stop": list(config.stop),
        "ignore_eos": config.ignore_eos, "on_long_prompt": config.on_long_prompt,
        "max_prompt_tokens": config.max_prompt_tokens,
        "output_schema": [[f.name, str(f.type)] for f in schema],
    }
    # only when set, so fingerprints of jobs begun before these options existed still match
    quantization = {"quantize": config.quantize, "quantize_backend": config.quantize_backend,
                    "kv_cache_dtype": config.kv_cache_dtype}
    if quantization != {"quantize": "none", "quantize_backend": "auto", "kv_cache_dtype": "auto"}:
        fingerprint.update(quantization)
    sampling = {"repetition_penalty": config.repetition_penalty, "presence_penalty": config.presence_penalty,
                "frequency_penalty": config.frequency_penalty, "min_tokens": config.min_tokens,
                "sampling_column": config.sampling_column}
    if sampling != {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
                    "sampling_column": None}:
        fingerprint.update(sampling)
    if model is not None:
        assert set(model) == {"model", *MODEL_KEYS}, sorted(model)
        fingerprint.update(model)
    return fingerprint


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key old -> new' for each compared key that differs. Only the keys of `new` are compared,
    so a fingerprint made before the model is loaded checks everything but MODEL_KEYS."""
    changes = []
    for key in new:
        if key in INFO_KEYS:
            continue
        if old.get(key) != new[key]:
            changes.append(f"{key} {_short(old.get(key))} -> {_short(new[key])}")
    return changes


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fingerprint_summary(fingerprint: dict[str, Any] | None) -> dict[str, Any] | None:
    if fingerprint is None:
        return None
    return {"digest": fingerprint_digest(fingerprint), **fingerprint}
