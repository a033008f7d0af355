"""Every option `run` and `plan` share, declared once, and how their values become JobConfig overrides.

Adding a job option is two local changes: an alias here (its flag, metavar and help) and its
line in cli/job_flags.py's JOB_FLAGS, which gives it to both commands. A parameter whose name is a
JobConfig field is passed through by `config_overrides`; RENAMED (batchgen.config.job.KEY_ALIASES, the
YAML keys' table) maps the few that differ.

Metavars are explicit (PATH, DIR, COL, N, ...): Typer's own render Python types (`<list[str]>`).
`--input` and `--output` cannot be click-required, because a --config file may set them; their
help says so, and JobConfig.validate names the missing one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from batchgen.cli.escapes import unescape
from batchgen.config.job import KEY_ALIASES

# CLI parameter -> JobConfig field, where the names differ: the YAML keys' own table
RENAMED = KEY_ALIASES
# parameters of a command that are not job settings
NOT_CONFIG = {"config", "calibrate", "calibration_rows", "as_json"}


def config_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """A command's parameters (its `locals()`) as build_config overrides; None = not given."""
    out = {RENAMED.get(name, name): value for name, value in params.items() if name not in NOT_CONFIG}
    # shells pass "\n" literally; in these flags users mean a newline, as in vLLM's stop=["\n"]
    if out.get("template") is not None:
        out["template"] = unescape(out["template"], "--template")
    if out.get("stop"):
        out["stop"] = [unescape(s, "--stop") for s in out["stop"]]
    return out


# each option's --help section (batchgen/cli/help.py), by its flag
_PANELS = {
    "Input": ("--input", "--input-format", "--prompt-column", "--id-column", "--max-rows", "--max-new-tokens-column",
              "--sampling-column", "--length-column", "--allow-empty-input"),
    "Prompt": ("--template", "--system", "--chat", "--chat-template", "--chat-template-kwargs",
               "--parse-special-tokens", "--on-long-prompt", "--max-prompt-tokens"),
    "Model": ("--model", "--trust-remote-code", "--device", "--dtype", "--quantize", "--quantize-backend",
              "--quantize-embedding", "--lora", "--lora-column", "--task", "--pooling", "--normalize", "--dimensions",
              "--score-column"),
    "Sampling": ("--max-new-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty",
                 "--presence-penalty", "--frequency-penalty", "--min-tokens", "--seed", "--stop", "--stop-token-ids",
                 "--include-stop-str-in-output", "--skip-special-tokens", "--ignore-eos", "--n", "--logprobs",
                 "--logit-bias", "--allowed-token-ids", "--json-schema", "--regex", "--choices",
                 "--json-schema-column", "--constraint-column"),
    "Output": ("--output", "--output-format", "--keep-columns", "--rows-per-part", "--commit-every",
               "--commit-every-seconds", "--stop-grace-seconds", "--checkpoint-in-flight-every", "--retry-errors",
               "--overwrite", "--max-error-rate"),
    "Engine": ("--batch-size", "--max-num-batched-tokens", "--kv-cache-memory", "--kv-cache-dtype", "--compile",
               "--attention-backend", "--block-size", "--cuda-graphs", "--mode", "--window-rows", "--sort-by-length",
               "--dedup", "--prefix-order", "--jump-forward", "--static-min-occupancy"),
    "Sharding and executors": ("--workers", "--num-shards", "--shard-index", "--executor", "--ray-actors",
                               "--ray-keep-warm"),
    "Monitoring": ("--quiet", "--metrics", "--metrics-textfile", "--metrics-port", "--metrics-host",
                   "--metrics-every-seconds"),
}
PANEL_OF = {flag: panel for panel, flags in _PANELS.items() for flag in flags}


def _opt(*names: str, metavar: str | None = None, help: str) -> typer.models.OptionInfo:
    panel = PANEL_OF.get(names[0].split("/")[0])  # None: the last section (--config)
    return typer.Option(*names, metavar=metavar, help=help, rich_help_panel=panel)


REQUIRED = "required, here or in --config"

Input = Annotated[list[str] | None, _opt("--input", "-i", metavar="PATH", help=(
    f"Input file, directory or glob (.parquet, .jsonl, .jsonl.gz); repeatable [{REQUIRED}]."))]
Output = Annotated[str | None, _opt("--output", "-o", metavar="DIR", help=(
    "Output directory: new, empty, or this job's own (a rerun resumes); with --output-format openai-batch, "
    "a .jsonl file [" + REQUIRED + "]."))]
InputFormat = Annotated[str | None, _opt("--input-format", metavar="FORMAT", help=(
    "auto | parquet | jsonl | openai-batch [auto: by file suffix]; openai-batch reads OpenAI Batch API "
    "request files (custom_id, method, url, body)."))]
OutputFormat = Annotated[str | None, _opt("--output-format", metavar="FORMAT", help=(
    "parquet | openai-batch | both [parquet]; openai-batch (and both) also write the Batch API's "
    "output.jsonl and errors.jsonl when the job completes (needs --input-format openai-batch)."))]
Config = Annotated[Path | None, _opt("--config", metavar="FILE", help="YAML config (see configs/); flags override it.")]
Model = Annotated[str | None, _opt("--model", metavar="MODEL", help=(
    "HF model id, local dir or .gguf [the embedded SmolLM2-135M-Instruct]."))]
TrustRemoteCode = Annotated[bool | None, _opt("--trust-remote-code", help=(
    "Allow the model's own Python code to run [off]."))]
Lora = Annotated[list[str] | None, _opt("--lora", metavar="NAME=DIR", help=(
    "A PEFT LoRA adapter to load under NAME; repeatable. Rows choose theirs with --lora-column (an OpenAI "
    "Batch request by its body's model); one --lora alone applies to every row [none]."))]
LoraColumn = Annotated[str | None, _opt("--lora-column", metavar="COL", help=(
    "Column naming each row's --lora adapter; null or empty: the base model."))]
Task = Annotated[str | None, _opt("--task", metavar="TASK", help=(
    "generate | embed | score | classify [generate]: embed writes an `embedding` per row, score its "
    "log-likelihood (logprob, num_scored_tokens, perplexity), classify a sequence-classification model's label "
    "and scores; these three run one forward pass per row and refuse generation's flags."))]
Pooling = Annotated[str | None, _opt("--pooling", metavar="MODE", help=(
    "--task embed: mean | cls | last [the model's: its sentence-transformers config, else mean for encoders, "
    "last for decoders]."))]
Normalize = Annotated[bool | None, _opt("--normalize/--no-normalize", help=(
    "--task embed: L2-normalize each embedding [the model's: on when its sentence-transformers modules "
    "normalize]."))]
Dimensions = Annotated[int | None, _opt("--dimensions", metavar="N", help=(
    "--task embed: keep the first N dimensions of each embedding (Matryoshka, OpenAI's `dimensions`), "
    "normalized after the cut when normalizing [all]."))]
ScoreColumn = Annotated[str | None, _opt("--score-column", metavar="COL", help=(
    "--task score: score this column's text as a continuation of the prompt (its tokens alone count) "
    "[off: every token of the prompt after the first]."))]
PromptColumn = Annotated[str | None, _opt("--prompt-column", metavar="COL", help="Column holding the prompt [text].")]
IdColumn = Annotated[str | None, _opt("--id-column", metavar="COL", help=(
    "Column of unique row ids [derived: file name + row index]."))]
Template = Annotated[str | None, _opt("--template", metavar="TEXT", help=(
    'Prompt template with {column} placeholders, e.g. "Summarize:\\n\\n{text}".'))]
System = Annotated[str | None, _opt("--system", metavar="TEXT", help="System prompt (chat models).")]
ChatTemplate = Annotated[str | None, _opt("--chat-template", metavar="FILE", help=(
    "Jinja chat template file replacing the tokenizer's own (vLLM's --chat-template; template text works too)."))]
ChatTemplateKwargs = Annotated[str | None, _opt("--chat-template-kwargs", metavar="JSON", help=(
    "JSON object of extra chat template variables, passed to apply_chat_template, e.g. "
    "'{\"enable_thinking\": false}'."))]
Chat = Annotated[bool | None, _opt("--chat/--no-chat", help=(
    "Apply the tokenizer's chat template [on when it has one]."))]
MaxNewTokens = Annotated[int | None, _opt("--max-new-tokens", "--max-tokens", metavar="N", help=(
    "Most tokens to generate per row (vLLM's max_tokens) [256]."))]
MaxNewTokensColumn = Annotated[str | None, _opt("--max-new-tokens-column", metavar="COL", help=(
    "Column with a per-row max_new_tokens (null = the default)."))]
Temperature = Annotated[float | None, _opt("--temperature", metavar="T", help="0 = greedy [0].")]
TopP = Annotated[float | None, _opt("--top-p", metavar="P", help="Nucleus sampling mass [1.0].")]
TopK = Annotated[int | None, _opt("--top-k", metavar="K", help="Sample from the k likeliest tokens [off].")]
RepetitionPenalty = Annotated[float | None, _opt("--repetition-penalty", metavar="X", help=(
    "Divide positive logits (multiply negative ones) of tokens already in the prompt or output by X; "
    "1 = off [1.0]."))]
PresencePenalty = Annotated[float | None, _opt("--presence-penalty", metavar="X", help=(
    "Subtract X from the logit of every token already generated, in [-2, 2] [0]."))]
FrequencyPenalty = Annotated[float | None, _opt("--frequency-penalty", metavar="X", help=(
    "Subtract X times its count from the logit of every token already generated, in [-2, 2] [0]."))]
MinTokens = Annotated[int | None, _opt("--min-tokens", metavar="N", help=(
    "Generate at least N tokens before EOS or a stop string may end a row [0]."))]
SamplingColumn = Annotated[str | None, _opt("--sampling-column", metavar="COL", help=(
    "Column of per-row sampling overrides: a JSON object (or struct) with any of temperature, top_p, "
    "top_k, repetition_penalty, presence_penalty, frequency_penalty, min_tokens, min_p, n (null = the job's)."))]
N = Annotated[int | None, _opt("--n", metavar="N", help=(
    "Samples per row (1-128), each with its own seeded stream; the prompt is prefilled once. One output row per "
    "sample, with a sample_index column [1]."))]
Logprobs = Annotated[int | None, _opt("--logprobs", metavar="K", help=(
    "Write each generated token's logprob and its K likeliest alternatives (0-20) in a `logprobs` list column."))]
JsonSchema = Annotated[str | None, _opt("--json-schema", metavar="FILE|JSON", help=(
    "Constrain every row's text to JSON valid against this schema (a file or inline JSON); adds a json_valid "
    "column."))]
Regex = Annotated[str | None, _opt("--regex", metavar="PATTERN", help="Constrain every row's text to match PATTERN.")]
Choices = Annotated[str | None, _opt("--choices", metavar="A,B,C", help=(
    "Constrain every row's text to exactly one of these comma-separated choices (labelling)."))]
JsonSchemaColumn = Annotated[str | None, _opt("--json-schema-column", metavar="COL", help=(
    "Column of per-row JSON schemas (JSON text; null = the job's constraint); adds a json_valid column."))]
ConstraintColumn = Annotated[str | None, _opt("--constraint-column", metavar="COL", help=(
    'Column of per-row constraints of any kind, a JSON object (or struct) per cell: {"type": "regex", '
    '"pattern": ...}, {"type": "choices", "choices": [...]}, {"type": "json_schema", "schema": ...} or '
    '{"type": "json_object"} (null = the job\'s constraint); adds a json_valid column.'))]
MinP = Annotated[float | None, _opt("--min-p", metavar="P", help=(
    "Sampled rows: drop tokens less likely than P times the likeliest token, in [0, 1]; 0 = off [0]."))]
StopTokenIds = Annotated[list[int] | None, _opt("--stop-token-ids", metavar="ID", help=(
    "Token id that ends a row as EOS does (even with --ignore-eos); repeatable."))]
LogitBias = Annotated[str | None, _opt("--logit-bias", metavar="JSON", help=(
    "JSON object of token id -> bias in [-100, 100] added to that token's logit, as OpenAI's and "
    "vLLM's logit_bias, e.g. '{\"198\": -100}'."))]
AllowedTokenIds = Annotated[list[int] | None, _opt("--allowed-token-ids", metavar="ID", help=(
    "Token id a row may generate (every other is masked), as vLLM's allowed_token_ids; repeatable."))]
IncludeStopStrInOutput = Annotated[bool | None, _opt("--include-stop-str-in-output/--no-include-stop-str-in-output",
                                                     help="Keep the stop string (or stop token) that ended a row in "
                                                          "its text [off].")]
SkipSpecialTokens = Annotated[bool | None, _opt("--skip-special-tokens/--no-skip-special-tokens", help=(
    "Leave special tokens out of the generated text [on]."))]
Seed = Annotated[int | None, _opt("--seed", metavar="N", help=(
    "Job seed; each row's seed derives from it and the row id [0]."))]
Stop = Annotated[list[str] | None, _opt("--stop", metavar="TEXT", help=(
    'Stop string; repeatable. Backslash escapes are read as in vLLM/JSON: --stop "\\n" stops at a newline.'))]
IgnoreEos = Annotated[bool | None, _opt("--ignore-eos", help="Generate through EOS (benchmarks).")]
BatchSize = Annotated[int | None, _opt("--batch-size", metavar="N", help=(
    "Sequences running at once [auto: what the KV cache holds of this job's rows, at most 256 on CPU, "
    "1024 on CUDA]."))]
MaxNumBatchedTokens = Annotated[int | None, _opt("--max-num-batched-tokens", metavar="N", help=(
    "Token budget per engine step [auto: 2048 on CPU, 8192 on CUDA]."))]
KvCacheMemory = Annotated[str | None, _opt("--kv-cache-memory", metavar="SIZE", help=(
    "KV cache budget, e.g. 2GiB [auto: 25% of free RAM up to 2 GiB on CPU, 90% of GPU memory on CUDA]; a job of "
    "at most --window-rows rows takes only what its rows need."))]
Compile = Annotated[bool | None, _opt("--compile/--no-compile", help=(
    "torch.compile the model's forward [off: on this project's CPUs it did not pay for its compile time; "
    "see README]."))]
ParseSpecialTokens = Annotated[bool | None, _opt("--parse-special-tokens/--no-parse-special-tokens", help=(
    "Read special-token text in rows (e.g. <|im_start|>) as control tokens, for pre-rendered prompts "
    "[on only with --no-chat]."))]
AttentionBackend = Annotated[str | None, _opt("--attention-backend", metavar="NAME", help=(
    "auto | cpu | sdpa | flash [auto: flash-attn on CUDA when installed, else sdpa; the C kernels on CPU]; "
    "the log says which and why."))]
BlockSize = Annotated[int | None, _opt("--block-size", metavar="N", help=(
    "Tokens per KV cache block [auto: the attention backend's: 256 for flash-attn, else 16]."))]
CudaGraphs = Annotated[bool | None, _opt("--cuda-graphs/--no-cuda-graphs", help=(
    "CUDA: decode-only steps replay CUDA graphs captured at start for padded batch sizes [on; needs flash-attn]."))]
Metrics = Annotated[bool | None, _opt("--metrics/--no-metrics", help=(
    "Write per-second engine, row and commit records to OUTPUT/_metrics/ (`batchgen report`) [on]."))]
MetricsTextfile = Annotated[str | None, _opt("--metrics-textfile", metavar="PATH", help=(
    "Rewrite this node-exporter textfile (.prom) with the job's Prometheus metrics every "
    "--metrics-every-seconds."))]
MetricsPort = Annotated[int | None, _opt("--metrics-port", metavar="PORT", help=(
    "Serve the Prometheus metrics over HTTP on this port while the job runs (0 = any free port)."))]
MetricsHost = Annotated[str | None, _opt("--metrics-host", metavar="HOST", help=(
    "Address --metrics-port listens on [127.0.0.1]."))]
MetricsEverySeconds = Annotated[float | None, _opt("--metrics-every-seconds", metavar="S", help=(
    "Seconds between metrics flushes and textfile rewrites [10]."))]
Mode = Annotated[str | None, _opt("--mode", metavar="MODE", help=(
    "auto | continuous | static [auto]: auto runs each planning window (--window-rows) static where its "
    "predicted lengths are alike, continuous where they are mixed."))]
WindowRows = Annotated[int | None, _opt("--window-rows", metavar="N", help=(
    "Rows planned together (sorted by predicted length, one mode); bounds memory [1024]."))]
LengthColumn = Annotated[str | None, _opt("--length-column", metavar="COL", help=(
    "Column of known output lengths in tokens (null cells are predicted)."))]
SortByLength = Annotated[bool | None, _opt("--sort-by-length/--no-sort-by-length", help=(
    "Run each planning window's rows longest predicted output first: static batches hold alike rows, continuous "
    "leaves the short rows for the draining tail [on]."))]
Dedup = Annotated[bool | None, _opt("--dedup/--no-dedup", help=(
    "Run rows whose prompt and settings decide the same output once (greedy rows, or sampled rows with "
    "the same explicit seed) and write it under each id [on]."))]
PrefixOrder = Annotated[bool | None, _opt("--prefix-order/--no-prefix-order", help=(
    "Run rows that share a prompt prefix (a document asked several questions) together, so the prefix "
    "is computed once and read from the cache by the others [on]."))]
JumpForward = Annotated[bool | None, _opt("--jump-forward/--no-jump-forward", help=(
    "--json-schema/--regex/--choices: run the tokens a grammar forces in the next forward, each kept "
    "only where it is the model's own pick (greedy rows; the output is the same) [on]."))]
StaticMinOccupancy = Annotated[float | None, _opt("--static-min-occupancy", metavar="X", help=(
    "auto: static when its batches would keep at least this share of slots busy [1.0]."))]
Device = Annotated[str | None, _opt("--device", metavar="DEVICE", help="auto | cpu | cuda [auto].")]
Dtype = Annotated[str | None, _opt("--dtype", metavar="DTYPE", help=(
    "auto | float32 | bfloat16 | float16 [auto: bf16 on CUDA; on CPU bf16 where native (avx512_bf16, AMX), "
    "else float32]."))]
Quantize = Annotated[str | None, _opt("--quantize", metavar="SCHEME", help=(
    "Weights: none | auto (a quantized GGUF's nearest) | int8 | int8-weight | int4 [none]."))]
QuantizeBackend = Annotated[str | None, _opt("--quantize-backend", metavar="NAME", help=(
    "auto | torchao | quanto | onednn (int8 on CPU) [auto]."))]
QuantizeEmbedding = Annotated[str | None, _opt("--quantize-embedding", metavar="SCHEME", help=(
    "Embedding/LM head: auto (int8 with --quantize int4) | none | int8 [auto]."))]
KvCacheDtype = Annotated[str | None, _opt("--kv-cache-dtype", metavar="DTYPE", help=(
    "auto (model dtype) | int8 (per-token, per-head scales) [auto]."))]
MaxRows = Annotated[int | None, _opt("--max-rows", metavar="N", help="Process only the first N rows [all].")]
Workers = Annotated[int | None, _opt("--workers", metavar="N", help=(
    "CPU: run the job as N shard processes of cores/N threads each (output in shard-I-of-N/), then "
    "finalize; 1 (default): one process"))]
NumShards = Annotated[int | None, _opt("--num-shards", metavar="N", help=(
    "Run one shard of a job split N ways (with --shard-index): a deterministic split of the input by file and "
    "row range; this process writes OUTPUT/shard-I-of-N/, and `batchgen finalize` checks the set [off]."))]
ShardIndex = Annotated[int | None, _opt("--shard-index", metavar="I", help=(
    "This process's shard, 0 to N-1 (with --num-shards; e.g. Airflow's map_index, a Kubernetes "
    "JOB_COMPLETION_INDEX)."))]
OnLongPrompt = Annotated[str | None, _opt("--on-long-prompt", metavar="POLICY", help="truncate | error [truncate].")]
MaxPromptTokens = Annotated[int | None, _opt("--max-prompt-tokens", metavar="N", help=(
    "Cut longer prompts (in their document part) to this many tokens [the context]."))]
KeepColumns = Annotated[list[str] | None, _opt("--keep-columns", metavar="COL", help=(
    "Input column to copy to the output; repeatable [all]."))]
MaxErrorRate = Annotated[float | None, _opt("--max-error-rate", metavar="X", help=(
    "Exit 3 (no _SUCCESS) when more than this fraction of the output's rows are error rows; 1 = never [0.5]."))]
AllowEmptyInput = Annotated[bool | None, _opt("--allow-empty-input/--no-allow-empty-input", help=(
    "An input without rows (0-byte files, 0-row Parquet) exits 0 with _SUCCESS and loads no model; "
    "--no-allow-empty-input: exit 2 instead [on]."))]
RowsPerPart = Annotated[int | None, _opt("--rows-per-part", metavar="N", help="Rows per output part file [1000].")]
CommitEvery = Annotated[int | None, _opt("--commit-every", metavar="N", help=(
    "Commit finished rows after this many, so a crash loses at most that much work [--rows-per-part]."))]
CommitEverySeconds = Annotated[float | None, _opt("--commit-every-seconds", metavar="S", help=(
    "Also commit finished rows this often; 0 = off [60]."))]
StopGraceSeconds = Annotated[float | None, _opt("--stop-grace-seconds", metavar="S", help=(
    "On SIGTERM/SIGINT, exit within this many seconds: finished rows commit first, then rows in flight are "
    "checkpointed and continued on resume; 0 = no limit [25]."))]
CheckpointInFlightEvery = Annotated[float | None, _opt("--checkpoint-in-flight-every", metavar="S", help=(
    "Also checkpoint rows in flight this often (seconds), so even kill -9 loses at most that much of each row; "
    "0 = off [off]."))]
RetryErrors = Annotated[bool | None, _opt("--retry-errors/--no-retry-errors", help=(
    "On resume, generate committed error rows again [on]."))]
Overwrite = Annotated[bool | None, _opt("--overwrite", help=(
    "Drop what an earlier job committed to --output and start over."))]
Quiet = Annotated[bool | None, _opt("--quiet", "-q", help="No progress bar; a log line every 30 s.")]
Executor = Annotated[str | None, _opt("--executor", metavar="NAME", help=(
    "local (this process) | ray (a Ray Data actor pool on the cluster RAY_ADDRESS names, else a local one; "
    "needs batchgen[ray]) [local]."))]
RayActors = Annotated[int | None, _opt("--ray-actors", metavar="N", help=(
    "--executor ray: actors, each with its own model [one per GPU; on CPUs one per node]."))]
RayKeepWarm = Annotated[float | None, _opt("--ray-keep-warm", metavar="SECONDS", help=(
    "--executor ray on a running cluster: generate in engine actors kept (models loaded) until idle this long, "
    "instead of Ray Data's actor pool, so the next job with the same model starts at once (they hold their "
    "CPUs/GPUs meanwhile) [0: off, the actor pool]."))]
