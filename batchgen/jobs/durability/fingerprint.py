"""The job fingerprint: every setting that decides what a row's output is, and nothing else.

A run whose fingerprint differs from the one the output directory was begun with is refused
(exit 2, naming what changed) unless --overwrite; with no committed rows yet there is nothing to
protect and the new run simply begins again (batchgen.jobs.durability.session).

In: the weights (content hash), the tokenizer (vocabulary, merges, special tokens, chat template:
`tokenizer_digest`), the EOS ids the engine stops on (tokenizer + generation config + model
config), dtype, sampling, template, system prompt, whether data may hold special tokens, the
limits the user set and the output schema. Out: anything sized from free memory (the KV cache,
batch sizes; a prompt cut to fit a smaller cache shows in its row's `prompt_hash`), and the
package version: a release that does not change outputs must not refuse a resume. OUTPUT_FORMAT
is bumped deliberately when a release does change what a row's output is.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa

from batchgen.config.constraint import job_constraint
from batchgen.config.job import JobConfig
from batchgen.config.text_settings import chat_template_text
from batchgen.io.manifest.manifest import fingerprint_digest
from batchgen.jobs.pipeline.rows import RowSource

OUTPUT_FORMAT = 1  # bump when a release changes the output of a row under the same settings
# Set after the model is loaded; compared only then. The dtype is the resolved one ("auto" may
# mean bfloat16 on one machine and float32 on another): greedy outputs differ between them.
MODEL_KEYS = ("model_revision", "dtype", "chat", "tokenizer", "eos_token_ids", "parse_special_tokens")
# Shown but never compared: the same model may be named by another path on a resume.
INFO_KEYS = ("model",)
# Keys a directory begun by an older batchgen does not record: not compared there (unknown), so
# such a directory still resumes. Keys an older fingerprint has and this one lacks
# (batchgen_version, max_context_tokens) are ignored (fingerprint_changes).
ADDED_KEYS = ("output_format", "tokenizer", "eos_token_ids", "parse_special_tokens")
# Keys job_fingerprint records only when not at their default (so that fingerprints of jobs begun
# before these options existed still match), with that default: a side that lacks one had it at
# the default. Both sides are compared over the union of their keys, so a resume that drops
# `--repetition-penalty 1.3` is refused as one that adds it is. None: absent means "not recorded"
# (a recipe, or an embedding setting of an int4 job begun before it was recorded), never a value.
DEFAULTS = {"input_format": "auto", "quantize": "none", "quantize_backend": "auto", "kv_cache_dtype": "auto",
            "quantize_embedding": None, "int4_recipe": None, "int8_recipe": None, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "sampling_column": None,
            "num_shards": None}


CONTROL_DEFAULTS = {"min_p": 0.0, "stop_token_ids": [], "include_stop_str_in_output": False,
                    "skip_special_tokens": True, "n": 1, "logprobs": None, "logit_bias": {}, "allowed_token_ids": [],
                    "constraint": None, "json_schema_column": None, "constraint_column": None}


def job_fingerprint(config: JobConfig, source: RowSource, schema: pa.Schema, *, model: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Settings that decide a row's output. `model` (from the loaded model and the prompt
    builder: MODEL_KEYS plus "model") is left out for the check made before loading."""
    fingerprint = {
        "output_format": OUTPUT_FORMAT,
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
    if config.input_format != "auto":  # how the files are read (openai-batch: as Batch API requests)
        fingerprint["input_format"] = config.input_format
    quantization = {"quantize": config.quantize, "quantize_backend": config.quantize_backend,
                    "kv_cache_dtype": config.kv_cache_dtype}
    if quantization != {"quantize": "none", "quantize_backend": "auto", "kv_cache_dtype": "auto"}:
        fingerprint.update(quantization)
    if config.quantize != "none" or config.quantize_embedding != "auto":
        # not in ADDED_KEYS on purpose: an int4 job begun before the embedding was quantized by default
        # would resume with other weights, so it is refused rather than mixed
        fingerprint["quantize_embedding"] = config.quantize_embedding
    if config.quantize in ("int4", "auto"):  # auto: a Q4 GGUF maps to int4
        from batchgen.engine.quant.recipe import INT4_RECIPE

        # the int4 group sizes: an int4 job begun under another recipe has other weights, so it is refused
        fingerprint["int4_recipe"] = INT4_RECIPE
    if config.quantize == "int8" and config.quantize_backend in ("auto", "onednn"):
        from batchgen.engine.quant.recipe import INT8_RECIPE

        # oneDNN's int8 recipe (outlier channels from a calibration pass, asymmetric down_proj,
        # engine/quant/recipe.py): a job begun under another recipe has other weights, so it is refused
        fingerprint["int8_recipe"] = INT8_RECIPE
    sampling = {"repetition_penalty": config.repetition_penalty, "presence_penalty": config.presence_penalty,
                "frequency_penalty": config.frequency_penalty, "min_tokens": config.min_tokens,
                "sampling_column": config.sampling_column}
    if sampling != {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
                    "sampling_column": None}:
        fingerprint.update(sampling)
    if config.chat_template is not None:  # its text, not its path: an edited file is another prompt
        text = chat_template_text(config.chat_template)
        fingerprint["chat_template"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    if config.chat_template_kwargs:
        fingerprint["chat_template_kwargs"] = config.chat_template_kwargs
    # vLLM's output controls, only when set: fingerprints of jobs begun before they existed still match
    controls = {"min_p": config.min_p, "stop_token_ids": list(config.stop_token_ids),
                "include_stop_str_in_output": config.include_stop_str_in_output,
                "skip_special_tokens": config.skip_special_tokens, "n": config.n, "logprobs": config.logprobs,
                # JSON keys are strings: the ids as a resumed run reads them back
                "logit_bias": {str(t): b for t, b in sorted(config.logit_bias.items())},
                "allowed_token_ids": list(config.allowed_token_ids),
                "constraint": constraint.describe() if (constraint := job_constraint(config)) is not None else None,
                "json_schema_column": config.json_schema_column, "constraint_column": config.constraint_column}
    fingerprint.update({k: v for k, v in controls.items() if v != CONTROL_DEFAULTS[k]})
    if config.num_shards is not None:
        # a sharded job's shards share one fingerprint (the index is the directory's name), and the
        # number of shards is in it: shards of two different splits of a job never pass as one set
        fingerprint["num_shards"] = config.num_shards
    if model is not None:
        assert set(model) == {"model", *MODEL_KEYS}, sorted(model)
        fingerprint.update(model)
    return fingerprint


def model_fingerprint(loaded, builder) -> dict[str, Any]:
    """The MODEL_KEYS (plus "model") of a loaded model and the job's prompt builder."""
    return {"model": loaded.name, "model_revision": loaded.revision,
            "dtype": str(loaded.dtype).removeprefix("torch."), "chat": builder.chat,
            "tokenizer": tokenizer_digest(loaded.tokenizer), "eos_token_ids": list(loaded.eos_token_ids),
            "parse_special_tokens": builder.parse_special_tokens}


def tokenizer_digest(tokenizer) -> str:
    """sha256[:16] over what the tokenizer does to text: its serialized pipeline (vocabulary,
    merges, normalizer, added and special tokens) and its chat template.

    Hashed from the loaded object rather than from files, so a hub id, a directory and a GGUF
    file are covered alike, and a file that does not change tokenization does not count.
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary, in id order
        h.update(json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])).encode())
    added = sorted((i, t.content, bool(t.special)) for i, t in tokenizer.added_tokens_decoder.items())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    chat_template = getattr(tokenizer, "chat_template", None)
    h.update(json.dumps([added, special, chat_template], ensure_ascii=False, default=str).encode())
    return h.hexdigest()[:16]


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key old -> new' for each compared key that differs.

    Compared: every key of `new`, and every DEFAULTS key of `old` (a key either side lacks has its
    default there). MODEL_KEYS only where `new` has them, so a fingerprint made before the model is
    loaded checks everything else; ADDED_KEYS missing from `old` (a directory begun by an older
    batchgen) are not compared; keys only an older fingerprint has (batchgen_version,
    max_context_tokens) are ignored."""
    changes = []
    for key in [*new, *(k for k in old if k in DEFAULTS and k not in new)]:
        if key in INFO_KEYS or (key in ADDED_KEYS and key not in old):
            continue
        before, after = _value(old, key), _value(new, key)
        if before != after:
            changes.append(f"{key} {_short(before)} -> {_short(after)}")
    return changes


def _value(fingerprint: dict[str, Any], key: str) -> Any:
    if key in fingerprint:
        return fingerprint[key]
    if key == "quantize_embedding" and fingerprint.get("quantize", "none") == "none":
        return "auto"  # recorded whenever quantize is set, else only when not auto
    return DEFAULTS.get(key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fingerprint_summary(fingerprint: dict[str, Any] | None) -> dict[str, Any] | None:
    if fingerprint is None:
        return None
    return {"digest": fingerprint_digest(fingerprint), **fingerprint}
