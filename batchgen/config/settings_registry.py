"""Which settings decide a row's output: one declaration for every JobConfig field.

The job fingerprint (batchgen.jobs.durability.fingerprint) is built from this table and compared
through it, so a resume that adds or drops a setting that changes what a row is gets refused
instead of mixing two configurations in one output. Three earlier settings reopened that hole by
being recorded "only when set" without the comparison knowing their default; a field added to
JobConfig without a declaration here now fails tests/config/test_settings_registry.py.

- Output(default): decides a row's output; recorded in the fingerprint under its own name, and
  left out when at `default` (so fingerprints of jobs begun before the setting existed still
  match). A fingerprint that lacks the key had the default. ALWAYS: recorded every time.
- Derived(keys): decides a row's output through fingerprint keys computed from it (the
  constraint's description, the chat template's hash, the loaded model's identity), declared in
  DERIVED_KEYS with the value a fingerprint that lacks them had.
- RunOnly(why): how the job runs, where it writes, how fast; never what a row's text is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALWAYS = object()  # Output(ALWAYS): recorded in every fingerprint, so absent never happens


@dataclass(frozen=True, slots=True)
class Output:
    default: Any


@dataclass(frozen=True, slots=True)
class Derived:
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RunOnly:
    why: str


SCHEDULING = "scheduling and sizing: greedy tokens are the same at any batch shape (the engine's equivalence tests)"
BOOKKEEPING = "when and how output is committed or reported, not what a row holds"

SETTINGS: dict[str, Output | Derived | RunOnly] = {
    "inputs": RunOnly("the rows themselves: their identity is checked on its own (jobs/durability/identity.py)"),
    "input_format": Output("auto"),
    "output": RunOnly("where the output goes"),
    "output_format": RunOnly("which files carry the rows; the Parquet schema is the output_schema key"),
    "model": Derived(("model_revision",)),
    "lora": Derived(("lora",)),
    "lora_column": Output(None),
    "trust_remote_code": RunOnly("whether a checkpoint's code may run; what it computes is the model's identity"),
    "task": Output("generate"),
    "pooling": Output(None),
    "normalize": Output(None),
    "dimensions": Output(None),
    "score_column": Output(None),
    "prompt_column": Output(ALWAYS),
    "id_column": Output(ALWAYS),
    "template": Output(ALWAYS),
    "system": Output(ALWAYS),
    "chat": Derived(("chat",)),
    "chat_template": Derived(("chat_template",)),
    "chat_template_kwargs": Output(None),
    "parse_special_tokens": Derived(("parse_special_tokens",)),
    "max_new_tokens": Output(ALWAYS),
    "max_new_tokens_column": Output(ALWAYS),
    "temperature": Output(ALWAYS),
    "top_p": Output(ALWAYS),
    "top_k": Output(ALWAYS),
    "repetition_penalty": Output(1.0),
    "presence_penalty": Output(0.0),
    "frequency_penalty": Output(0.0),
    "min_tokens": Output(0),
    "min_p": Output(0.0),
    "stop_token_ids": Output([]),
    "logit_bias": Output({}),
    "allowed_token_ids": Output([]),
    "include_stop_str_in_output": Output(False),
    "skip_special_tokens": Output(True),
    "logprobs": Output(None),
    "n": Output(1),
    "sampling_column": Output(None),
    "json_schema": Derived(("constraint",)),
    "regex": Derived(("constraint",)),
    "choices": Derived(("constraint",)),
    "json_schema_column": Output(None),
    "constraint_column": Output(None),
    "seed": Output(ALWAYS),
    "stop": Output(ALWAYS),
    "ignore_eos": Output(ALWAYS),
    "batch_size": RunOnly(SCHEDULING),
    "max_num_batched_tokens": RunOnly(SCHEDULING),
    "block_size": RunOnly(SCHEDULING),
    "attention_backend": RunOnly("kernels that compute the same attention"),
    "cuda_graphs": RunOnly("replays the same forward"),
    "kv_cache_memory": RunOnly("sized from free memory; a prompt cut to fit shows in its row's prompt_hash"),
    "enable_prefix_caching": RunOnly("reuses the same prompt blocks"),
    "jump_forward": RunOnly("a forced token stays only where it is the model's own pick, so the tokens are the same"),
    "dedup": RunOnly("a copy gets the tokens its prompt and settings decide, computed once"),
    "prefix_order": RunOnly("orders rows; a row's shared prompt blocks hold the K/V its own prefill would"),
    "compile": RunOnly("compiles the same forward"),
    "mode": RunOnly(SCHEDULING),
    "window_rows": RunOnly(SCHEDULING),
    "length_column": RunOnly("orders rows; a row's budget is max_new_tokens (or its column)"),
    "sort_by_length": RunOnly(SCHEDULING),
    "static_min_occupancy": RunOnly(SCHEDULING),
    "device": RunOnly("where the forward runs; the resolved dtype is the dtype key"),
    "dtype": Derived(("dtype",)),
    "quantize": Output("none"),
    "quantize_backend": Output("auto"),
    "quantize_embedding": Derived(("quantize_embedding",)),
    "kv_cache_dtype": Output("auto"),
    "max_rows": RunOnly("how many rows this run takes; the next run resumes"),
    "num_shards": Output(None),
    "shard_index": RunOnly("the shard's directory name: shards of one job share one fingerprint"),
    "on_long_prompt": Output(ALWAYS),
    "max_prompt_tokens": Output(ALWAYS),
    "keep_columns": RunOnly("passthrough columns: the output_schema key"),
    "max_error_rate": RunOnly(BOOKKEEPING),
    "allow_empty_input": RunOnly("whether a run over no rows exits 0 or 2; no row is generated either way"),
    "rows_per_part": RunOnly(BOOKKEEPING),
    "commit_every_rows": RunOnly(BOOKKEEPING),
    "commit_every_s": RunOnly(BOOKKEEPING),
    "stop_grace_s": RunOnly(BOOKKEEPING),
    "checkpoint_in_flight_every_s": RunOnly(BOOKKEEPING),
    "retry_errors": RunOnly("whether committed error rows run again; each row's output is decided as before"),
    "overwrite": RunOnly("drops the old output instead of comparing with it"),
    "read_batch_size": RunOnly(SCHEDULING),
    "quiet": RunOnly(BOOKKEEPING),
    "log_every_s": RunOnly(BOOKKEEPING),
    "metrics": RunOnly(BOOKKEEPING),
    "metrics_every_s": RunOnly(BOOKKEEPING),
    "metrics_textfile": RunOnly(BOOKKEEPING),
    "metrics_port": RunOnly(BOOKKEEPING),
    "metrics_host": RunOnly(BOOKKEEPING),
    "executor": RunOnly("which processes run the same engine"),
    "ray_actors": RunOnly(SCHEDULING),
    "ray_keep_warm_s": RunOnly(SCHEDULING),
    "workers": RunOnly(SCHEDULING),
}

# Fingerprint keys that are not a setting's own name, with the value a fingerprint that lacks the
# key had (None: not recorded, compared as such: a side that records one is refused by the other).
DERIVED_KEYS: dict[str, Any] = {
    "output_format": None,  # OUTPUT_FORMAT, bumped when a release changes a row's output
    "output_schema": None,
    "constraint": None,  # --json-schema / --regex / --choices, as the compiled constraint describes itself
    "chat_template": None,  # the template text's hash: an edited file is another prompt
    "int4_recipe": None,  # the int4 group sizes of --quantize int4/auto
    "int8_recipe": None,  # oneDNN's int8 calibration recipe
    "quantize_embedding": None,  # recorded under quantization (fingerprint._value has its absent rule)
    # the loaded model's identity (MODEL_KEYS), set only once it is loaded
    "model_revision": None, "dtype": None, "chat": None, "tokenizer": None, "eos_token_ids": None,
    "parse_special_tokens": None,
    "lora": None,  # {adapter name: content hash}: an adapter changed on disk is another job
}


def output_settings() -> dict[str, Output]:
    """The settings recorded under their own name, with their defaults."""
    return {name: s for name, s in SETTINGS.items() if isinstance(s, Output)}


def deciding_settings() -> list[str]:
    """Every setting that decides a row's output (Output or Derived)."""
    return [name for name, s in SETTINGS.items() if not isinstance(s, RunOnly)]


def absent_value(key: str) -> Any:
    """The value of `key` in a fingerprint that lacks it (its default); KeyError for an undeclared key."""
    setting = SETTINGS.get(key)
    if isinstance(setting, Output):  # ALWAYS: lacking only where an older batchgen did not record it yet
        return None if setting.default is ALWAYS else setting.default
    return DERIVED_KEYS[key]


def is_declared(key: str) -> bool:
    """Whether `key` is a fingerprint key this batchgen knows."""
    return isinstance(SETTINGS.get(key), Output) or key in DERIVED_KEYS
