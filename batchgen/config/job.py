"""JobConfig: one validated record of everything a job needs, from YAML plus CLI overrides.

Precedence: built-in defaults < config file (--config) < command-line flags. The merge lives here
and the validation in batchgen/config/rules.py, so the CLI stays thin and tests can build configs directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from batchgen.config.choices import Policy
from batchgen.config.rules import (
    AUTO,
    KEY_ALIASES,
    LONG_PROMPT_POLICIES,
    OPENAI_BATCH,
    check_penalties,
    check_types,
    parse_bytes,
    validate_job_config,
)
from batchgen.config.suggest import did_you_mean
from batchgen.errors import ConfigError

# importers take these from here; their definitions sit with the rules
__all__ = ["AUTO", "KEY_ALIASES", "LONG_PROMPT_POLICIES", "OPENAI_BATCH", "JobConfig", "build_config",
           "check_penalties", "load_config_file", "parse_bytes"]


@dataclass(slots=True)
class JobConfig:
    inputs: list[str] = field(default_factory=list)
    input_format: str = "auto"  # auto (by suffix) | parquet | jsonl | openai-batch (Batch API requests)
    output: str | None = None
    output_format: str = "parquet"  # parquet | openai-batch (+ Batch API output.jsonl/errors.jsonl) | both
    model: str | None = None  # None = the embedded default model
    trust_remote_code: bool = False
    # PEFT LoRA adapters by name -> directory (docs/lora.md); the flag: --lora NAME=DIR, repeatable
    lora: dict[str, str] = field(default_factory=dict)
    lora_column: str | None = None  # each row's adapter by name; null or empty: the base model
    # what a row's output is (config/choices.py Task): generate decodes; embed, score and classify run one
    # forward pass per row (engine/encode/) and refuse generation's settings (config/task_rules.py)
    task: str = "generate"
    pooling: str | None = None  # embed: a Pooling value; None = the model's (its sentence-transformers config)
    normalize: bool | None = None  # embed: L2-normalize the vector; None = the model's (a Normalize module)
    dimensions: int | None = None  # embed: keep the first N dimensions (Matryoshka, OpenAI's `dimensions`)
    score_column: str | None = None  # score: the log-likelihood of this column's text after the prompt
    prompt_column: str = "text"
    id_column: str | None = None  # None = "<file name>:<row index>", stable across runs
    template: str | None = None  # "{column}" placeholders only
    system: str | None = None
    chat: bool | None = None  # None = on when the tokenizer has a chat template
    chat_template: str | None = None  # Jinja file or text replacing the tokenizer's own; the text once validated
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (a JSON object)
    parse_special_tokens: bool | None = None  # row text may hold control tokens; None = only with chat off
    max_new_tokens: int = 256
    max_new_tokens_column: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    # vLLM's SamplingParams (engine/sampling/sampler.py has the definitions); 1.0 / 0.0 / 0 = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # tokens generated before EOS or a stop string may end a row
    min_p: float = 0.0  # sampled rows: drop tokens below min_p x the likeliest token's probability; 0 = off
    stop_token_ids: list[int] = field(default_factory=list)  # token ids that end a row, as EOS does
    # vLLM's token controls (config/token_controls.py): {token id: bias} added to the logits; the only
    # ids a row may generate (empty = any)
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text keeps the stop string (or stop token) that ended it
    skip_special_tokens: bool = True  # the text leaves special tokens out
    # each generated token's logprob and this many likeliest alternatives, as a `logprobs` list column; None = off
    logprobs: int | None = None
    # samples per row (vLLM's and OpenAI's `n`): one output row each, with a sample_index column
    n: int = 1
    sampling_column: str | None = None  # per-row overrides of the above (a JSON object or struct per cell)
    # structured output (config/constraint.py), at most one of these three: a JSON schema (a file, inline
    # JSON or, in YAML, a mapping; the parsed schema once validated), a regex, or the texts a row may be
    json_schema: Any = None
    regex: str | None = None
    choices: list[str] | None = None  # the flag takes "a,b,c"
    json_schema_column: str | None = None  # a per-row JSON schema (null cell = the job's constraint)
    # a per-row constraint of any kind: {"type": "json_schema" | "json_object" | "regex" | "choices", ...}
    # (config/constraint.py's Constraint.from_object; null cell = the job's constraint)
    constraint_column: str | None = None
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    batch_size: int | None = None  # static: rows per batch; continuous: max running sequences; None: auto
    max_num_batched_tokens: int | None = None  # token budget per step; None: auto (engine/scheduler/sizing.py)
    block_size: int | None = None  # tokens per KV block; None: the attention backend's (256 flash-attn, else 16)
    attention_backend: str = "auto"  # auto | cpu | sdpa | flash (engine/attention/registry.py: auto's rule)
    cuda_graphs: bool = True  # CUDA: replay captured graphs for decode-only steps (engine/model/cuda_graphs.py)
    kv_cache_memory: str | None = None  # e.g. "2GiB"; None = sized automatically
    enable_prefix_caching: bool = True
    # structured output: a grammar's forced tokens run as drafts checked against the model's picks
    # instead of one decode step each (engine/sampling/jump_forward.py); the output is the same
    jump_forward: bool = True
    dedup: bool = True  # rows whose prompt and settings decide the same output run once (jobs/planning/duplicates.py)
    prefix_order: bool = True  # rows sharing a prompt prefix run together (jobs/planning/prefix_groups.py)
    compile: bool = False  # torch.compile the forward (docs/performance.md: where it pays)
    mode: str = AUTO  # a Policy value, or auto: chosen per window by the planner (batchgen.jobs.planning.planner)
    window_rows: int = 1024  # planning window: rows sorted by predicted length together (bounds memory)
    length_column: str | None = None  # known output lengths (tokens) per row; null cells are predicted
    sort_by_length: bool = True  # rows run longest predicted output first (both modes)
    static_min_occupancy: float = 1.0  # auto: static when its batches would keep this share of slots busy
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"  # weights: none | auto | int8 | int8-weight | int4 (engine/quant/quantize.py)
    quantize_backend: str = "auto"  # auto | torchao | quanto | onednn (int8 on CPU)
    quantize_embedding: str = "auto"  # embedding/LM head: auto | none | int8
    kv_cache_dtype: str = "auto"  # auto (model dtype) | int8 | fp8
    max_rows: int | None = None
    # one shard of a sharded job (batchgen.jobs.rows.split): this process reads its share of the input and
    # writes output/shard-{shard_index}-of-{num_shards}/; None = the whole job in one process
    num_shards: int | None = None
    shard_index: int | None = None
    on_long_prompt: str = "truncate"
    max_prompt_tokens: int | None = None  # cap prompts below the context (cut in the document part)
    keep_columns: list[str] | None = None  # None = pass every other input column through
    # fail (exit 3, no _SUCCESS) when error rows exceed this fraction of the output; on by default so
    # that a job whose rows mostly failed (a setting no row can meet) is not marked done; 1 or None = never
    max_error_rate: float | None = 0.5
    # an input without rows (an empty partition) finishes at once: exit 0, _SUCCESS, no model loaded;
    # False: exit 2 instead, for a job that must never find its input empty
    allow_empty_input: bool = True
    rows_per_part: int = 1000  # rows per output Parquet part file
    commit_every_rows: int | None = None  # commit after this many finished rows; None = rows_per_part
    commit_every_s: float | None = 60.0  # also commit finished rows this often; None or 0 = off
    # first SIGTERM/SIGINT -> exit at the latest (finished rows commit first, then in-flight
    # checkpoints); the default fits a 30 s eviction notice. None or 0 = no limit
    stop_grace_s: float | None = 25.0
    # also checkpoint in-flight rows this often, so a kill -9 loses at most this much of each row;
    # None or 0 = off (a signal still checkpoints them)
    checkpoint_in_flight_every_s: float | None = None
    retry_errors: bool = True  # a resumed run generates committed error rows again
    overwrite: bool = False  # drop what an earlier job committed to the output directory
    read_batch_size: int = 256  # rows per input record batch
    quiet: bool = False
    log_every_s: float = 30.0
    metrics: bool = True  # per-second records in <output>/_metrics/ (batchgen.monitor)
    metrics_every_s: float = 10.0  # flush (and textfile) interval
    metrics_textfile: str | None = None  # node-exporter textfile path
    metrics_port: int | None = None  # Prometheus scrape endpoint; 0 = any free port
    metrics_host: str = "127.0.0.1"  # localhost unless asked: the endpoint has no authentication
    executor: str = "local"  # local: this process; ray: a Ray Data actor pool on RAY_ADDRESS's cluster (executors/ray/)
    ray_actors: int | None = None  # ray: actors (models loaded); None = one per GPU, else one per node
    ray_keep_warm_s: float = 0.0  # ray: > 0: kept-warm engines (jobs/executors/ray/engines.py), not the actor pool
    # CPU: the job as this many shard processes, then finalize (jobs/executors/workers.py); None = 1
    workers: int | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def replace(self, **changes: Any) -> JobConfig:
        return dataclasses.replace(self, **changes)

    def engine_policy(self) -> Policy:
        """The policy of the job's first engine: the mode asked for; continuous for auto."""
        return Policy.CONTINUOUS if self.mode == AUTO else Policy(self.mode)

    def validate(self, *, need_output: bool = True) -> JobConfig:
        """Raise ConfigError naming the first invalid setting; return self for chaining.

        `need_output=False`: a dry run (`batchgen plan`) writes nothing. The rules: batchgen/config/rules.py."""
        validate_job_config(self, need_output=need_output)
        return self


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config into a dict of JobConfig fields (dashes accepted in keys)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))  # safe_load: data is never executed
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping of settings, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    given: dict[str, Any] = {}  # field -> the key that set it
    known = JobConfig.field_names()
    for key, value in raw.items():
        name = KEY_ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in known:
            raise ConfigError(f"{p}: unknown setting {key!r}{_did_you_mean(str(key).replace('-', '_'))} "
                              "(configs/default.yaml lists every setting)")
        if name in given:
            raise ConfigError(f"{p}: {given[name]!r} and {key!r} are the same setting; keep one")
        given[name] = key
        out[name] = value
    for name in ("stop_token_ids", "allowed_token_ids"):  # one id = a list of one
        if isinstance(out.get(name), int):
            out[name] = [out[name]]
    for name in ("inputs", "stop", "keep_columns"):  # one string = a list of one, not of characters
        if isinstance(out.get(name), str):
            out[name] = [out[name]]
    return out


def _did_you_mean(key: str) -> str:
    """'; did you mean 'x'?' for the closest known key, or '' when none is close."""
    return did_you_mean(key, sorted(JobConfig.field_names() | set(KEY_ALIASES)))


def build_config(config_file: str | Path | None = None, *, need_output: bool = True, **overrides: Any) -> JobConfig:
    """Defaults < config file < overrides (None overrides mean 'not given' and are skipped)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(load_config_file(config_file))
    for key, value in overrides.items():
        if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
            continue
        values[key] = list(value) if isinstance(value, tuple) else value
    try:
        config = JobConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    check_types(config)
    return config.validate(need_output=need_output)
