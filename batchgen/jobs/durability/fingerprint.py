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
from batchgen.config.settings_registry import ALWAYS, absent_value, is_declared, output_settings
from batchgen.config.text_settings import chat_template_text
from batchgen.engine.lora.files import adapter_hashes
from batchgen.io.manifest.manifest import fingerprint_digest
from batchgen.jobs.rows.rows import RowSource

OUTPUT_FORMAT = 1  # bump when a release changes the output of a row under the same settings
# Set after the model is loaded; compared only then. The dtype is the resolved one ("auto" may
# mean bfloat16 on one machine and float32 on another): greedy outputs differ between them.
MODEL_KEYS = ("model_revision", "dtype", "chat", "tokenizer", "eos_token_ids", "parse_special_tokens")
# Shown but never compared: the same model may be named by another path on a resume.
INFO_KEYS = ("model",)
# Keys a directory begun by an older batchgen does not record: not compared there (unknown), so
# such a directory still resumes.
ADDED_KEYS = ("output_format", "tokenizer", "eos_token_ids", "parse_special_tokens")
# Keys only an older batchgen recorded: ignored (the package version must not refuse a resume; the
# context capped by an auto-sized KV cache followed free memory).
RETIRED_KEYS = ("batchgen_version", "max_context_tokens")


def job_fingerprint(config: JobConfig, source: RowSource, schema: pa.Schema, *, model: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Settings that decide a row's output, as settings_registry declares them. `model` (from the
    loaded model and the prompt builder: MODEL_KEYS plus "model") is left out for the check made
    before loading."""
    fingerprint: dict[str, Any] = {"output_format": OUTPUT_FORMAT, "model": config.model,
                                   "output_schema": [[f.name, str(f.type)] for f in schema]}
    for name, setting in output_settings().items():
        value = _recorded(getattr(config, name))
        # left out at the default: fingerprints of jobs begun before the setting existed still match
        if setting.default is ALWAYS or value != setting.default:
            fingerprint[name] = value
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
    if config.chat_template is not None:  # its text, not its path: an edited file is another prompt
        text = chat_template_text(config.chat_template)
        fingerprint["chat_template"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    if (constraint := job_constraint(config)) is not None:
        fingerprint["constraint"] = constraint.describe()
    if config.lora:  # each adapter's content, its config checked first: one changed on disk is another job
        fingerprint["lora"] = adapter_hashes(config.lora)
    if model is not None:
        assert set(model) == {"model", *MODEL_KEYS}, sorted(model)
        fingerprint.update(model)
    undeclared = [key for key in fingerprint if key not in INFO_KEYS and not is_declared(key)]
    assert not undeclared, f"fingerprint keys missing from settings_registry: {undeclared}"
    return fingerprint


def _recorded(value: Any) -> Any:
    """A setting's value as the fingerprint's JSON holds it (and a resumed run reads it back)."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):  # logit_bias's ids become strings in JSON: sort and stringify now
        return {str(k): v for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return value


def model_fingerprint(loaded, builder) -> dict[str, Any]:
    """The MODEL_KEYS (plus "model") of a loaded model and the job's prompt builder."""
    return {"model": loaded.name, "model_revision": loaded.revision,
            "dtype": str(loaded.dtype).removeprefix("torch."), "chat": builder.chat,
            "tokenizer": tokenizer_digest(loaded.tokenizer), "eos_token_ids": list(loaded.eos_token_ids),
            "parse_special_tokens": builder.parse_special_tokens}


def encode_model_fingerprint(model, builder) -> dict[str, Any]:
    """The MODEL_KEYS (plus "model") of an embed / score / classify job's EncodeModel: its files' content
    identity is the revision (pooling and normalization read from those files are covered by it), and
    it stops on no EOS."""
    return {"model": model.name, "model_revision": model.files_identity,
            "dtype": str(model.dtype).removeprefix("torch."), "chat": builder.chat,
            "tokenizer": tokenizer_digest(model.tokenizer), "eos_token_ids": [],
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

    Compared: the union of both sides' keys, a key either side lacks having its declared default
    there (settings_registry). MODEL_KEYS only where `new` has them, so a fingerprint made before
    the model is loaded checks everything else; ADDED_KEYS missing from `old` (a directory begun by
    an older batchgen) are not compared; RETIRED_KEYS are ignored."""
    changes = []
    for key in dict.fromkeys([*new, *old]):
        if key in INFO_KEYS or key in RETIRED_KEYS or (key in ADDED_KEYS and key not in old):
            continue
        if key in MODEL_KEYS and key not in new:
            continue
        if not is_declared(key):  # a key this batchgen does not know: a newer batchgen's setting
            changes.append(f"{key} {_short(old.get(key))} -> {_short(new.get(key))} (a setting this batchgen "
                           "does not know: resume with the batchgen that began the job)")
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
    return absent_value(key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fingerprint_summary(fingerprint: dict[str, Any] | None) -> dict[str, Any] | None:
    if fingerprint is None:
        return None
    return {"digest": fingerprint_digest(fingerprint), **fingerprint}
