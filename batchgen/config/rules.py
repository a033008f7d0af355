"""The rules a JobConfig must satisfy: each setting's allowed values and ranges, and the
combinations refused before any work (what an object-store output, --executor ray or Batch API
input cannot do yet). batchgen.config.job holds the record itself and how it is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchgen.config.choices import (
    ATTENTION_BACKEND_ALIASES,
    ATTENTION_BACKENDS,
    MAX_LOGPROBS,
    MAX_SAMPLES,
    Policy,
    canonical_attention_backend,
)
from batchgen.config.keys import KEY_ALIASES, NO_FLAG, TOP_K_OFF, label
from batchgen.config.lora_settings import lora_settings
from batchgen.config.output_url import check_output_url, job_output_dir, names_batch_file
from batchgen.config.task_rules import task_settings
from batchgen.config.text_settings import chat_template_settings, constraint_settings
from batchgen.config.token_controls import read_logit_bias, read_token_ids
from batchgen.errors import ConfigError

if TYPE_CHECKING:
    from batchgen.config.job import JobConfig

__all__ = ["KEY_ALIASES", "NO_FLAG", "TOP_K_OFF", "label"]  # named here too: where callers found them before

AUTO = "auto"  # the mode that lets the length planner choose a Policy per planning window
MODES = (AUTO, *(p.value for p in Policy))
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LONG_PROMPT_POLICIES = ("truncate", "error")
QUANTIZE = ("none", "auto", "int8", "int8-weight", "int4")  # auto: a quantized GGUF's nearest scheme, else none
QUANTIZE_BACKENDS = ("auto", "torchao", "quanto", "onednn")
QUANTIZE_EMBEDDING = ("auto", "none", "int8")  # auto: int8 with int4 weights (engine/quant/plan.py EMBEDDING_AUTO)
KV_CACHE_DTYPES = ("auto", "int8")  # fp8: refused before any load (FP8_KV_REFUSAL), so not offered
OPENAI_BATCH = "openai-batch"  # the OpenAI Batch API's request / output JSONL (jobs/openai/requests.py)
INPUT_FORMATS = ("auto", "parquet", "jsonl", OPENAI_BATCH)  # auto: by file suffix
OUTPUT_FORMATS = ("parquet", OPENAI_BATCH, "both")
# openai-batch input: the row id is the request's custom_id, the prompt comes from its body, and
# these columns of the reader's (batchgen.io.inputs.openai_batch) are always kept: the output files need them
OPENAI_ID_COLUMN = "custom_id"
OPENAI_BODY_COLUMN = "body"
OPENAI_KEPT_COLUMNS = ("method", "url", "model")
EXECUTORS = ("local", "ray")
# apply_chat_template arguments batchgen passes itself: --chat-template-kwargs may not set them
# engine/kv/quant.py's fp8_refusal says the same with the device in hand
FP8_KV_REFUSAL = ("--kv-cache-dtype fp8 is not available: batchgen has no fp8 attention kernel yet (on CUDA it "
                  "would need flash-attn 3 on Hopper; there is none on CPU); use --kv-cache-dtype int8 "
                  "(every device)")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Allowed:
    """One setting's own values: those `ok` passes (None too where `unset_ok`); an error says
    "LABEL must be WORDS, got VALUE" (choices: "...; got")."""

    ok: Callable[[Any], bool]
    words: str
    unset_ok: bool = False
    then: str = ","

    def check(self, name: str, value: Any) -> None:
        if not (value is None and self.unset_ok) and not self.ok(value):
            raise ConfigError(f"{label(name)} must be {self.words}{self.then} got {value!r}")


def _one_of(choices: tuple[str, ...]) -> Allowed:
    return Allowed(lambda value: value in choices, f"one of {', '.join(choices)}", then=";")


POSITIVE = Allowed(lambda value: _integer(value) and value >= 1, "a positive integer")
POSITIVE_OR_UNSET = dataclasses.replace(POSITIVE, unset_ok=True)
SECONDS_OR_OFF = Allowed(lambda value: _number(value) and not value < 0, "a number of seconds >= 0 (0 = off)",
                         unset_ok=True)
TRUE_OR_FALSE = Allowed(lambda value: isinstance(value, bool), "true or false")
# max_rows, max_error_rate, temperature, top_p, top_k: check_types has refused a YAML value of the wrong type.
# A rule written `not value < 0` lets a NaN (YAML .nan) through; one written `0 <= value` refuses it
VALUES: dict[str, Allowed] = {  # setting -> its own values, in the order they are checked
    "max_new_tokens": POSITIVE, "batch_size": POSITIVE_OR_UNSET, "max_num_batched_tokens": POSITIVE_OR_UNSET,
    "block_size": POSITIVE_OR_UNSET, "rows_per_part": POSITIVE, "read_batch_size": POSITIVE, "window_rows": POSITIVE,
    "static_min_occupancy": Allowed(lambda value: _number(value) and 0.0 <= value <= 1.0, "a number in [0, 1]"),
    "commit_every_rows": POSITIVE_OR_UNSET, "commit_every_s": SECONDS_OR_OFF, "stop_grace_s": SECONDS_OR_OFF,
    "checkpoint_in_flight_every_s": SECONDS_OR_OFF,
    "max_rows": Allowed(lambda value: not value < 0, ">= 0", unset_ok=True),
    "max_prompt_tokens": POSITIVE_OR_UNSET,
    "max_error_rate": Allowed(lambda value: 0.0 <= value <= 1.0, "in [0, 1]", unset_ok=True),
    "temperature": Allowed(lambda value: 0 <= value < math.inf, "a finite number >= 0"),
    "top_p": Allowed(lambda value: 0.0 < value <= 1.0, "in (0, 1]"),
    "top_k": Allowed(lambda value: not value < 1, ">= 1, or -1 / 0 for no limit", unset_ok=True, then=";"),
    "mode": _one_of(MODES), "device": _one_of(DEVICES), "dtype": _one_of(DTYPES), "quantize": _one_of(QUANTIZE),
    "quantize_backend": _one_of(QUANTIZE_BACKENDS), "quantize_embedding": _one_of(QUANTIZE_EMBEDDING),
    "kv_cache_dtype": _one_of(KV_CACHE_DTYPES),
    "attention_backend": _one_of((*ATTENTION_BACKENDS, *ATTENTION_BACKEND_ALIASES)),
    "cuda_graphs": TRUE_OR_FALSE, "on_long_prompt": _one_of(LONG_PROMPT_POLICIES),
    "input_format": _one_of(INPUT_FORMATS), "output_format": _one_of(OUTPUT_FORMATS),
    "executor": _one_of(EXECUTORS), "workers": POSITIVE_OR_UNSET, "ray_actors": POSITIVE_OR_UNSET,
    "ray_keep_warm_s": Allowed(lambda value: _number(value) and not value < 0, "a number of seconds >= 0"),
    "n": Allowed(lambda value: _integer(value) and 1 <= value <= MAX_SAMPLES,
                 f"an integer in [1, {MAX_SAMPLES}] (samples per row)"),
    "logprobs": Allowed(lambda value: _integer(value) and 0 <= value <= MAX_LOGPROBS,
                        f"an integer in [0, {MAX_LOGPROBS}] (the alternatives listed per token; unset = off)",
                        unset_ok=True),
    "min_p": Allowed(lambda value: _number(value) and 0.0 <= value <= 1.0, "a number in [0, 1] (0 = off)"),
    "include_stop_str_in_output": TRUE_OR_FALSE, "skip_special_tokens": TRUE_OR_FALSE,
    "metrics_every_s": Allowed(lambda value: _number(value) and not value <= 0, "a number of seconds > 0"),
    "metrics_port": Allowed(lambda value: _integer(value) and 0 <= value <= 65535,
                            "a port number 0-65535 (0 = any free port)", unset_ok=True),
}


def validate_job_config(config: JobConfig, *, need_output: bool) -> None:
    """Raise ConfigError naming the first invalid setting of `config`; fill in what the settings
    imply ("auto" limits to None, a Batch API input's id, prompt and kept columns).

    Each setting's own values first (VALUES), then what takes several settings together."""
    if not config.inputs:
        raise ConfigError("no input given: pass --input PATH (a file, directory or glob)")
    if need_output and not config.output:
        raise ConfigError("no output directory given: pass --output DIR")
    if config.output:
        check_output_url(str(config.output))
    for name in ("batch_size", "max_num_batched_tokens", "block_size"):
        if getattr(config, name) == "auto":  # a config file's spelling of the default
            setattr(config, name, None)
    if config.top_k in TOP_K_OFF and not isinstance(config.top_k, bool):
        config.top_k = None  # vLLM's -1 (and 0) mean no limit
    if config.kv_cache_dtype == "fp8":
        raise ConfigError(FP8_KV_REFUSAL)
    for name, allowed in VALUES.items():
        allowed.check(name, getattr(config, name))
    config.attention_backend = canonical_attention_backend(config.attention_backend)
    check_shard_flags(config.num_shards, config.shard_index)
    check_penalties(config.repetition_penalty, config.presence_penalty, config.frequency_penalty, config.min_tokens,
                    ConfigError, label)
    chat_template_settings(config)
    constraint_settings(config)
    lora_settings(config)
    _combinations(config)
    if config.input_format == OPENAI_BATCH:
        _openai_batch_settings(config)
    elif config.output_format != "parquet":
        raise ConfigError(f"output_format {config.output_format} needs Batch API requests as input: "
                          "pass --input-format openai-batch")
    if names_batch_file(config.output):  # one Batch output file, its bookkeeping beside it (output_url.py)
        if config.output_format != OPENAI_BATCH:
            raise ConfigError(f"--output {config.output} names one JSON Lines file, but --output-format "
                              f"{config.output_format} writes a directory of Parquet parts: pass --output-format "
                              f"{OPENAI_BATCH} for the OpenAI Batch output file, or name a directory")
        config.output = job_output_dir(config.output)
    if not isinstance(config.stop_token_ids, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in config.stop_token_ids):
        raise ConfigError(f"{label('stop_token_ids')} must be token ids (integers >= 0), got {config.stop_token_ids!r}")
    if isinstance(config.logit_bias, str):  # the flag's JSON
        try:
            config.logit_bias = json.loads(config.logit_bias)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{label('logit_bias')}: not valid JSON: {e}") from None
    config.logit_bias = read_logit_bias(config.logit_bias, ConfigError, label("logit_bias"))
    config.allowed_token_ids = read_token_ids(config.allowed_token_ids, ConfigError, label("allowed_token_ids"))
    if any(s == "" for s in config.stop):
        raise ConfigError(f"{label('stop')}: a stop string must not be empty")
    if config.kv_cache_memory is not None:
        parse_bytes(config.kv_cache_memory)
    task_settings(config)  # last: the settings above are in their normal form, so "given" means off its default


def _combinations(config: JobConfig) -> None:
    """Settings that cannot go together whatever the model and the machine: refused here, before
    any load, so that the mistake costs no model load first (the engine and the prompt
    builder keep their own checks for callers that build them directly)."""
    if config.system is not None and config.chat is False:
        raise ConfigError("--system needs the chat template, and --no-chat turns it off: drop one of them, "
                          "or put the text in --template")
    if config.n > 1 and config.executor == "ray":
        raise ConfigError("--n runs on the local executor: the Ray executor writes one row per input row")
    if config.logprobs is not None and config.executor == "ray":
        raise ConfigError("--logprobs runs on the local executor: the Ray executor writes no logprobs column")
    if config.kv_cache_dtype == "int8" and config.attention_backend == "flash":
        raise ConfigError("--kv-cache-dtype int8 runs on --attention-backend cpu or torch: flash-attn reads no "
                          "int8 KV pages")
    if config.quantize_backend == "onednn" and (config.quantize in ("int8-weight", "int4") or (
            config.quantize != "none" and config.device == "cuda")):
        raise ConfigError(f"--quantize-backend onednn runs --quantize int8 on CPU only; got --quantize "
                          f"{config.quantize} --device {config.device}")
    if config.quantize_backend == "quanto" and config.quantize == "int8":
        raise ConfigError("--quantize int8 (dynamic int8 activations) runs on torchao only: use "
                          "--quantize-backend torchao, or --quantize int8-weight for quanto")


def _openai_batch_settings(config: JobConfig) -> None:
    """Batch API requests carry their own id, prompt and limits: the flags that would name
    columns for them are refused, and the id, prompt and kept columns are set (idempotent)."""
    for name in ("template", "system", "max_new_tokens_column", "sampling_column", "length_column", "json_schema",
                 "regex", "choices", "json_schema_column", "constraint_column"):
        if getattr(config, name) is not None:
            raise ConfigError(f"{label(name)} does not apply to --input-format openai-batch: each request's body "
                              "carries its messages or prompt, max_tokens, sampling settings and response_format")
    if config.chat is False:
        raise ConfigError("--no-chat does not apply to --input-format openai-batch: /v1/chat/completions "
                          "requests use the model's chat template, /v1/completions prompts never do")
    if config.id_column not in (None, OPENAI_ID_COLUMN):
        raise ConfigError(f"--input-format openai-batch: the row id is the request's custom_id, "
                          f"not {config.id_column!r}")
    config.id_column = OPENAI_ID_COLUMN
    config.prompt_column = OPENAI_BODY_COLUMN
    kept = list(config.keep_columns) if config.keep_columns is not None else []
    config.keep_columns = [*OPENAI_KEPT_COLUMNS, *(c for c in kept if c not in OPENAI_KEPT_COLUMNS)]


def check_penalties(repetition: Any, presence: Any, frequency: Any, min_tokens: Any, error: Callable[[str], Exception],
                    name: Callable[[str], str] = str) -> None:
    """vLLM's ranges for the penalties; raise `error` naming the first value outside them, as
    `name` spells a setting (label: the flag and YAML key; a sampling cell: its own key)."""
    for key, value in (("repetition_penalty", repetition), ("presence_penalty", presence),
                       ("frequency_penalty", frequency)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{name(key)} must be a number, got {value!r}")
    if not repetition > 0:
        raise error(f"{name('repetition_penalty')} must be > 0 (1 = off), got {repetition}")
    for key, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= value <= 2.0:
            raise error(f"{name(key)} must be in [-2, 2] (0 = off), got {value}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise error(f"{name('min_tokens')} must be an integer >= 0, got {min_tokens!r}")


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
             "gib": 2**30}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ConfigError(f"{label('kv_cache_memory')}: cannot read {text!r} as a size (e.g. 512MiB, 2GiB)")
    return int(value * units[unit])



def check_types(config: JobConfig) -> None:
    """The settings a YAML file may spell with the wrong type, refused before validate_job_config compares them."""
    for name, kind in (("max_new_tokens", int), ("seed", int),
                       ("temperature", (int, float)), ("top_p", (int, float))):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"{label(name)} must be a number, got {value!r}")
    # Optional numbers: validate() compares them with <, which a YAML string would turn into a TypeError.
    for name, kind in (("top_k", int), ("max_rows", int), ("max_error_rate", (int, float))):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{label(name)} must be {what} or unset, got {value!r}")


def check_shard_flags(num_shards: int | None, shard_index: int | None) -> None:
    """Both or neither, and 0 <= I < N (a ConfigError naming the flag)."""
    if num_shards is None and shard_index is None:
        return
    if num_shards is None or shard_index is None:
        given, missing = ("--num-shards", "--shard-index") if shard_index is None else ("--shard-index",
                                                                                          "--num-shards")
        raise ConfigError(f"{given} needs {missing} too: each shard process is told the number of shards and its "
                          "own index (0-based)")
    for name, value in (("num_shards", num_shards), ("shard_index", shard_index)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    if num_shards < 1:
        raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ConfigError(f"shard_index must be in [0, {num_shards - 1}] for --num-shards {num_shards}, "
                          f"got {shard_index}")
