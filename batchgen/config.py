"""JobConfig: one validated record of everything a job needs, from YAML plus CLI overrides.

Precedence: built-in defaults < config file (--config) < command-line flags. The merge and all
validation live here so the CLI stays thin and tests can build configs directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from batchgen.engine.scheduler import Policy
from batchgen.errors import ConfigError

AUTO = "auto"  # the mode that lets the length planner choose a Policy per shard
MODES = (AUTO, *(p.value for p in Policy))
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LONG_PROMPT_POLICIES = ("truncate", "error")
QUANTIZE = ("none", "auto", "int8", "int8-weight", "int4")  # auto: a quantized GGUF's nearest scheme, else none
QUANTIZE_BACKENDS = ("auto", "torchao", "quanto", "onednn")
QUANTIZE_EMBEDDING = ("auto", "none", "int8")  # auto: int8 with int4 weights (engine/quantize.py EMBEDDING_AUTO)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash")
OPENAI_BATCH = "openai-batch"  # the OpenAI Batch API's request / output JSONL (jobs/openai_requests.py)
INPUT_FORMATS = ("auto", "parquet", "jsonl", OPENAI_BATCH)  # auto: by file suffix
OUTPUT_FORMATS = ("parquet", OPENAI_BATCH, "both")
# openai-batch input: the row id is the request's custom_id, the prompt comes from its body, and
# these columns of the reader's (batchgen.io.openai_batch) are always kept: the output files need them
OPENAI_ID_COLUMN = "custom_id"
OPENAI_BODY_COLUMN = "body"
OPENAI_KEPT_COLUMNS = ("method", "url", "model")
EXECUTORS = ("local", "ray")


@dataclass(slots=True)
class JobConfig:
    inputs: list[str] = field(default_factory=list)
    input_format: str = "auto"  # auto (by suffix) | parquet | jsonl | openai-batch (Batch API requests)
    output: str | None = None
    output_format: str = "parquet"  # parquet | openai-batch (+ Batch API output.jsonl/errors.jsonl) | both
    model: str | None = None  # None = the embedded default model
    trust_remote_code: bool = False
    prompt_column: str = "text"
    id_column: str | None = None  # None = "<file name>:<row index>", stable across runs
    template: str | None = None  # "{column}" placeholders only
    system: str | None = None
    chat: bool | None = None  # None = on when the tokenizer has a chat template
    parse_special_tokens: bool | None = None  # row text may hold control tokens; None = only with chat off
    max_new_tokens: int = 256
    max_new_tokens_column: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    # vLLM's SamplingParams (engine/sampling.py has the definitions); 1.0 / 0.0 / 0 = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # tokens generated before EOS or a stop string may end a row
    sampling_column: str | None = None  # per-row overrides of the above (a JSON object or struct per cell)
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    batch_size: int | None = None  # static: rows per batch; continuous: max running sequences; None: auto
    max_num_batched_tokens: int | None = None  # token budget per step; None: auto (engine/sizing.py)
    block_size: int | None = None  # tokens per KV block; None: the attention backend's (256 flash-attn, else 16)
    attention_backend: str = "auto"  # auto | torch | cpu | flash (engine/attention.py: auto's rule)
    cuda_graphs: bool = True  # CUDA: replay captured graphs for decode-only steps (engine/cuda_graphs.py)
    kv_cache_memory: str | None = None  # e.g. "2GiB"; None = sized automatically
    enable_prefix_caching: bool = True
    compile: bool = False  # torch.compile the forward (README: where it pays)
    mode: str = AUTO  # a Policy value, or auto: chosen per shard by the length planner (batchgen.jobs.planner)
    window_rows: int = 1024  # planning window: rows sorted by predicted length together (bounds memory)
    length_column: str | None = None  # known output lengths (tokens) per row; null cells are predicted
    sort_by_length: bool = True  # rows run longest predicted output first (both modes)
    static_min_occupancy: float = 1.0  # auto: static when its batches would keep this share of slots busy
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"  # weights: none | auto | int8 | int8-weight | int4 (engine/quantize.py)
    quantize_backend: str = "auto"  # auto | torchao | quanto | onednn (int8 on CPU)
    quantize_embedding: str = "auto"  # embedding/LM head: auto | none | int8
    kv_cache_dtype: str = "auto"  # auto (model dtype) | int8 | fp8
    max_rows: int | None = None
    # one shard of a sharded job (batchgen.jobs.split): this process reads its share of the input and
    # writes output/shard-{shard_index}-of-{num_shards}/; None = the whole job in one process
    num_shards: int | None = None
    shard_index: int | None = None
    on_long_prompt: str = "truncate"
    max_prompt_tokens: int | None = None  # cap prompts below the context (cut in the document part)
    keep_columns: list[str] | None = None  # None = pass every other input column through
    max_error_rate: float | None = None  # fail (exit 3) when error rows exceed this fraction
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
    executor: str = "local"  # local: this process; ray: a Ray Data actor pool (batchgen.ray), RAY_ADDRESS's cluster
    ray_actors: int | None = None  # ray: actors (models loaded); None = one per GPU, else one per node

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

        `need_output=False`: a dry run (`batchgen plan`) writes nothing."""
        if not self.inputs:
            raise ConfigError("no input given: pass --input PATH (a file, directory or glob)")
        if need_output and not self.output:
            raise ConfigError("no output directory given: pass --output DIR")
        if self.output:
            from batchgen.io.writers import refuse_url_output  # io imports no config: no cycle

            refuse_url_output(self.output)
        _positive("max_new_tokens", self.max_new_tokens)
        for name in ("batch_size", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) == "auto":  # a config file's spelling of the default
                setattr(self, name, None)
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _positive("rows_per_part", self.rows_per_part)
        _positive("read_batch_size", self.read_batch_size)
        _positive("window_rows", self.window_rows)
        if (isinstance(self.static_min_occupancy, bool) or not isinstance(self.static_min_occupancy, (int, float))
                or not 0.0 <= self.static_min_occupancy <= 1.0):
            raise ConfigError(f"static_min_occupancy must be a number in [0, 1], got {self.static_min_occupancy!r}")
        if self.commit_every_rows is not None:
            _positive("commit_every_rows", self.commit_every_rows)
        if self.commit_every_s is not None and (isinstance(self.commit_every_s, bool)
                                                or not isinstance(self.commit_every_s, (int, float))
                                                or self.commit_every_s < 0):
            raise ConfigError(f"commit_every_s must be a number of seconds >= 0 (0 = off), got {self.commit_every_s!r}")
        for name in ("stop_grace_s", "checkpoint_in_flight_every_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ConfigError(f"{name} must be a number of seconds >= 0 (0 = off), got {value!r}")
        from batchgen.jobs.split import check_shard_flags  # pyarrow-only imports: no cycle, no torch

        check_shard_flags(self.num_shards, self.shard_index)
        if self.max_rows is not None and self.max_rows < 0:
            raise ConfigError(f"max_rows must be >= 0, got {self.max_rows}")
        if self.max_prompt_tokens is not None:
            _positive("max_prompt_tokens", self.max_prompt_tokens)
        if self.max_error_rate is not None and not 0.0 <= self.max_error_rate <= 1.0:
            raise ConfigError(f"max_error_rate must be in [0, 1], got {self.max_error_rate}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1 (or unset), got {self.top_k}")
        check_penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.min_tokens,
                        ConfigError)
        _choice("mode", self.mode, MODES)
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("quantize", self.quantize, QUANTIZE)
        _choice("quantize_backend", self.quantize_backend, QUANTIZE_BACKENDS)
        _choice("quantize_embedding", self.quantize_embedding, QUANTIZE_EMBEDDING)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        _choice("on_long_prompt", self.on_long_prompt, LONG_PROMPT_POLICIES)
        _choice("input_format", self.input_format, INPUT_FORMATS)
        _choice("output_format", self.output_format, OUTPUT_FORMATS)
        if self.input_format == OPENAI_BATCH:
            self._openai_batch_settings()
        elif self.output_format != "parquet":
            raise ConfigError(f"output_format {self.output_format} needs Batch API requests as input: "
                              "pass --input-format openai-batch")
        if self.output:
            self._object_store_output()
        _choice("executor", self.executor, EXECUTORS)
        if self.ray_actors is not None:
            _positive("ray_actors", self.ray_actors)
        if self.executor == "ray":
            self._ray_executor()
        if any(s == "" for s in self.stop):
            raise ConfigError("stop strings must not be empty")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if (isinstance(self.metrics_every_s, bool) or not isinstance(self.metrics_every_s, (int, float))
                or self.metrics_every_s <= 0):
            raise ConfigError(f"metrics_every_s must be a number of seconds > 0, got {self.metrics_every_s!r}")
        if self.metrics_port is not None and (isinstance(self.metrics_port, bool) or not isinstance(
                self.metrics_port, int) or not 0 <= self.metrics_port <= 65535):
            raise ConfigError(f"metrics_port must be a port number 0-65535 (0 = any free port), "
                              f"got {self.metrics_port!r}")
        return self

    def _object_store_output(self) -> None:
        """What an s3:// / gs:// --output (batchgen.io.store) does not support yet: refused before any work.

        The OpenAI Batch files (batchgen.jobs.openai_output: temp files renamed into place) are
        written on a local filesystem. A sharded job's shards (OUTPUT/shard-I-of-N/ prefixes) and
        `batchgen finalize` work on a store."""
        from batchgen.io.store import is_url

        if not is_url(self.output):
            return
        if self.output_format != "parquet":
            raise ConfigError(f"--output-format {self.output_format} needs a local or mounted --output directory, "
                              f"not {self.output}: the Batch API output files are written on a local filesystem; "
                              "use --output-format parquet with an object-store output")

    def _ray_executor(self) -> None:
        """What --executor ray (batchgen.ray) does not support yet: refused before any work.

        Its driver reads whole input files (no shard's share of them), writes through the local
        metrics and output directory, and its batch function builds prompts from --prompt-column /
        --template, not from Batch API request bodies."""
        from batchgen.io.store import is_url

        if self.num_shards is not None:
            raise ConfigError("--executor ray does not run one shard of a sharded job (--num-shards/--shard-index): "
                              "Ray spreads the whole input over its actors; run it once, without shards")
        if self.output and is_url(self.output):
            raise ConfigError(f"--executor ray needs a local or mounted --output directory, not {self.output}: "
                              "use --executor local with an object-store output")
        if self.input_format == OPENAI_BATCH:
            raise ConfigError("--executor ray does not read --input-format openai-batch requests yet: "
                              "use --executor local")

    def _openai_batch_settings(self) -> None:
        """Batch API requests carry their own id, prompt and limits: the flags that would name
        columns for them are refused, and the id, prompt and kept columns are set (idempotent)."""
        for name in ("template", "system", "max_new_tokens_column", "sampling_column", "length_column"):
            if getattr(self, name) is not None:
                raise ConfigError(f"{name} does not apply to --input-format openai-batch: each request's body "
                                  "carries its messages or prompt, max_tokens and sampling settings")
        if self.chat is False:
            raise ConfigError("--no-chat does not apply to --input-format openai-batch: /v1/chat/completions "
                              "requests use the model's chat template, /v1/completions prompts never do")
        if self.id_column not in (None, OPENAI_ID_COLUMN):
            raise ConfigError(f"--input-format openai-batch: the row id is the request's custom_id, "
                              f"not {self.id_column!r}")
        self.id_column = OPENAI_ID_COLUMN
        self.prompt_column = OPENAI_BODY_COLUMN
        kept = list(self.keep_columns) if self.keep_columns is not None else []
        self.keep_columns = [*OPENAI_KEPT_COLUMNS, *(c for c in kept if c not in OPENAI_KEPT_COLUMNS)]


def check_penalties(repetition: Any, presence: Any, frequency: Any, min_tokens: Any, error: type[Exception]) -> None:
    """vLLM's ranges for the penalties; raise `error` naming the first value outside them."""
    for name, value in (("repetition_penalty", repetition), ("presence_penalty", presence),
                        ("frequency_penalty", frequency)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{name} must be a number, got {value!r}")
    if not repetition > 0:
        raise error(f"repetition_penalty must be > 0 (1 = off), got {repetition}")
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= value <= 2.0:
            raise error(f"{name} must be in [-2, 2] (0 = off), got {value}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise error(f"min_tokens must be an integer >= 0, got {min_tokens!r}")


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
        raise ConfigError(f"kv_cache_memory: cannot read {text!r} as a size (e.g. 512MiB, 2GiB)")
    return int(value * units[unit])


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
    known = JobConfig.field_names()
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name == "input":
            name = "inputs"
        if name not in known:
            raise ConfigError(f"{p}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
        out[name] = value
    for name in ("inputs", "stop", "keep_columns"):  # one string = a list of one, not of characters
        if isinstance(out.get(name), str):
            out[name] = [out[name]]
    return out


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
    _check_types(config)
    return config.validate(need_output=need_output)


def _check_types(config: JobConfig) -> None:
    for name, kind in (("max_new_tokens", int), ("seed", int),
                       ("temperature", (int, float)), ("top_p", (int, float))):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"{name} must be a number, got {value!r}")
    # Optional numbers: validate() compares them with <, which a YAML string would turn into a TypeError.
    for name, kind in (("top_k", int), ("max_rows", int), ("max_error_rate", (int, float))):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{name} must be {what} or unset, got {value!r}")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
