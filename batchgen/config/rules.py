"""The rules a JobConfig must satisfy: each setting's allowed values and ranges, and the
combinations refused before any work (what an object-store output, --executor ray or Batch API
input cannot do yet). batchgen.config.job holds the record itself and how it is built.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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

AUTO = "auto"  # the mode that lets the length planner choose a Policy per shard
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


def validate_job_config(config: JobConfig, *, need_output: bool) -> None:
    """Raise ConfigError naming the first invalid setting of `config`; fill in what the settings
    imply ("auto" limits to None, a Batch API input's id, prompt and kept columns)."""
    if not config.inputs:
        raise ConfigError("no input given: pass --input PATH (a file, directory or glob)")
    if need_output and not config.output:
        raise ConfigError("no output directory given: pass --output DIR")
    if config.output:
        check_output_url(str(config.output))
    _positive("max_new_tokens", config.max_new_tokens)
    for name in ("batch_size", "max_num_batched_tokens", "block_size"):
        if getattr(config, name) == "auto":  # a config file's spelling of the default
            setattr(config, name, None)
        if getattr(config, name) is not None:
            _positive(name, getattr(config, name))
    _positive("rows_per_part", config.rows_per_part)
    _positive("read_batch_size", config.read_batch_size)
    _positive("window_rows", config.window_rows)
    if (isinstance(config.static_min_occupancy, bool) or not isinstance(config.static_min_occupancy, (int, float))
            or not 0.0 <= config.static_min_occupancy <= 1.0):
        raise ConfigError(f"{label('static_min_occupancy')} must be a number in [0, 1], "
                          f"got {config.static_min_occupancy!r}")
    if config.commit_every_rows is not None:
        _positive("commit_every_rows", config.commit_every_rows)
    if config.commit_every_s is not None and (isinstance(config.commit_every_s, bool)
                                            or not isinstance(config.commit_every_s, (int, float))
                                            or config.commit_every_s < 0):
        raise ConfigError(f"{label('commit_every_s')} must be a number of seconds >= 0 (0 = off), "
                          f"got {config.commit_every_s!r}")
    for name in ("stop_grace_s", "checkpoint_in_flight_every_s"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ConfigError(f"{label(name)} must be a number of seconds >= 0 (0 = off), got {value!r}")
    check_shard_flags(config.num_shards, config.shard_index)
    if config.max_rows is not None and config.max_rows < 0:
        raise ConfigError(f"{label('max_rows')} must be >= 0, got {config.max_rows}")
    if config.max_prompt_tokens is not None:
        _positive("max_prompt_tokens", config.max_prompt_tokens)
    if config.max_error_rate is not None and not 0.0 <= config.max_error_rate <= 1.0:
        raise ConfigError(f"{label('max_error_rate')} must be in [0, 1], got {config.max_error_rate}")
    if config.temperature < 0:
        raise ConfigError(f"{label('temperature')} must be >= 0, got {config.temperature}")
    if not 0.0 < config.top_p <= 1.0:
        raise ConfigError(f"{label('top_p')} must be in (0, 1], got {config.top_p}")
    if config.top_k in TOP_K_OFF and not isinstance(config.top_k, bool):
        config.top_k = None  # vLLM's -1 (and 0) mean no limit
    if config.top_k is not None and config.top_k < 1:
        raise ConfigError(f"{label('top_k')} must be >= 1, or -1 / 0 for no limit; got {config.top_k}")
    check_penalties(config.repetition_penalty, config.presence_penalty, config.frequency_penalty, config.min_tokens,
                    ConfigError, label)
    _choice("mode", config.mode, MODES)
    _choice("device", config.device, DEVICES)
    _choice("dtype", config.dtype, DTYPES)
    _choice("quantize", config.quantize, QUANTIZE)
    _choice("quantize_backend", config.quantize_backend, QUANTIZE_BACKENDS)
    _choice("quantize_embedding", config.quantize_embedding, QUANTIZE_EMBEDDING)
    if config.kv_cache_dtype == "fp8":
        raise ConfigError(FP8_KV_REFUSAL)
    _choice("kv_cache_dtype", config.kv_cache_dtype, KV_CACHE_DTYPES)
    _choice("attention_backend", config.attention_backend, (*ATTENTION_BACKENDS, *ATTENTION_BACKEND_ALIASES))
    config.attention_backend = canonical_attention_backend(config.attention_backend)
    if not isinstance(config.cuda_graphs, bool):
        raise ConfigError(f"{label('cuda_graphs')} must be true or false, got {config.cuda_graphs!r}")
    _choice("on_long_prompt", config.on_long_prompt, LONG_PROMPT_POLICIES)
    _choice("input_format", config.input_format, INPUT_FORMATS)
    _choice("output_format", config.output_format, OUTPUT_FORMATS)
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
    _choice("executor", config.executor, EXECUTORS)
    if config.workers is not None:
        _positive("workers", config.workers)
    if config.ray_actors is not None:
        _positive("ray_actors", config.ray_actors)
    if (isinstance(config.ray_keep_warm_s, bool) or not isinstance(config.ray_keep_warm_s, (int, float))
            or config.ray_keep_warm_s < 0):
        raise ConfigError(f"{label('ray_keep_warm_s')} must be a number of seconds >= 0, "
                          f"got {config.ray_keep_warm_s!r}")
    if isinstance(config.n, bool) or not isinstance(config.n, int) or not 1 <= config.n <= MAX_SAMPLES:
        raise ConfigError(f"{label('n')} must be an integer in [1, {MAX_SAMPLES}] (samples per row), got {config.n!r}")
    if config.logprobs is not None and (isinstance(config.logprobs, bool) or not isinstance(config.logprobs, int)
                                        or not 0 <= config.logprobs <= MAX_LOGPROBS):
        raise ConfigError(f"{label('logprobs')} must be an integer in [0, {MAX_LOGPROBS}] (the alternatives listed "
                          f"per token; unset = off), got {config.logprobs!r}")
    if isinstance(config.min_p, bool) or not isinstance(config.min_p, (int, float)) or not 0.0 <= config.min_p <= 1.0:
        raise ConfigError(f"{label('min_p')} must be a number in [0, 1] (0 = off), got {config.min_p!r}")
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
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{label(name)} must be true or false, got {getattr(config, name)!r}")
    if any(s == "" for s in config.stop):
        raise ConfigError(f"{label('stop')}: a stop string must not be empty")
    if config.kv_cache_memory is not None:
        parse_bytes(config.kv_cache_memory)
    if (isinstance(config.metrics_every_s, bool) or not isinstance(config.metrics_every_s, (int, float))
            or config.metrics_every_s <= 0):
        raise ConfigError(f"{label('metrics_every_s')} must be a number of seconds > 0, got {config.metrics_every_s!r}")
    if config.metrics_port is not None and (isinstance(config.metrics_port, bool) or not isinstance(
            config.metrics_port, int) or not 0 <= config.metrics_port <= 65535):
        raise ConfigError(f"{label('metrics_port')} must be a port number 0-65535 (0 = any free port), "
                          f"got {config.metrics_port!r}")
    task_settings(config)  # last: the settings above are in their normal form, so "given" means off its default


def _combinations(config: JobConfig) -> None:
    """Settings that cannot go together whatever the model and the machine: refused here, before
    any load, where they used to surface after the model had loaded (the engine and the prompt
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


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{label(name)} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{label(name)} must be one of {', '.join(allowed)}; got {value!r}")


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
