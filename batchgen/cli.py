"""The `batchgen` command line: thin Typer commands over batchgen.jobs.

User mistakes (BatchgenError) become one line on stderr and the error's exit code; see
batchgen.errors for the table. Anything else is a bug: exit 1 with the traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from batchgen import __version__, omp
from batchgen.errors import BatchgenError

# rich_markup_mode=None: plain click help. Rich markup reads the "[text]", "[auto]" defaults in the
# option help as style tags and drops them, and its table cuts long flag names on 80 columns.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Offline batch LLM generation: Parquet/JSONL prompts in, Parquet out.")


MODE_HELP = ("auto | continuous | static [auto]: auto runs each shard static where its predicted lengths "
             "are alike, continuous where they are mixed.")
WINDOW_ROWS_HELP = "Rows planned together (sorted by predicted length, one mode); bounds memory [1024]."
LENGTH_COLUMN_HELP = "Column of known output lengths in tokens (null cells are predicted)."
SORT_HELP = ("Run each shard's rows longest predicted output first: static batches hold alike rows, "
             "continuous leaves the short rows for the draining tail [on].")
OCCUPANCY_HELP = "auto: static when its batches would keep at least this share of slots busy [1.0]."

# options `run` and `plan` share, declared once
_InputOpt = Annotated[list[str] | None, typer.Option("--input", "-i", help="Input file, directory or glob "
    "(.parquet, .jsonl, .jsonl.gz); repeatable.")]
_ConfigOpt = Annotated[Path | None, typer.Option(help="YAML config (see configs/); flags override it.")]
_ModelOpt = Annotated[str | None, typer.Option(help="HF model id, local dir or .gguf; default: the "
    "embedded SmolLM2-135M-Instruct.")]
_TrustRemoteCodeOpt = Annotated[bool | None, typer.Option("--trust-remote-code", help="Allow the "
    "model's own Python code to run (off unless asked).")]
_PromptColumnOpt = Annotated[str | None, typer.Option(help="Column holding the prompt [text].")]
_SystemOpt = Annotated[str | None, typer.Option(help="System prompt (chat models).")]
_ChatOpt = Annotated[bool | None, typer.Option("--chat/--no-chat", help="Apply the tokenizer's chat "
    "template [on when it has one].")]
_ParseSpecialTokensOpt = Annotated[bool | None, typer.Option("--parse-special-tokens/--no-parse-special-tokens",
    help="Read special-token text in rows (e.g. <|im_start|>) as control tokens, for pre-rendered prompts "
    "[on only with --no-chat].")]
_MaxNewTokensOpt = Annotated[int | None, typer.Option(help="Most tokens to generate per row [256].")]
_MaxNewTokensColumnOpt = Annotated[str | None, typer.Option(help="Column with a per-row "
    "max_new_tokens (null = the default).")]
_BatchSizeOpt = Annotated[int | None, typer.Option(help="Sequences running at once [auto: what the KV cache "
    "holds of this job's rows, at most 256 on CPU, 1024 on CUDA].")]
_MaxNumBatchedTokensOpt = Annotated[int | None, typer.Option(help="Token budget per engine step "
    "[auto: 2048 on CPU, 8192 on CUDA].")]
_KvCacheMemoryOpt = Annotated[str | None, typer.Option(help="KV cache size, e.g. 2GiB [auto].")]
_CompileOpt = Annotated[bool | None, typer.Option("--compile/--no-compile", help="torch.compile the model's "
    "forward [off: on this project's CPUs it did not pay for its compile time; see README].")]
_ModeOpt = Annotated[str | None, typer.Option(help=MODE_HELP)]
_AttentionBackendOpt = Annotated[str | None, typer.Option(help="auto | torch | cpu | flash [auto: flash-attn on "
    "CUDA when installed, else torch; the C kernel on CPU]; the log says which and why.")]
_BlockSizeOpt = Annotated[int | None, typer.Option(help="Tokens per KV cache block [auto: the attention "
    "backend's: 256 for flash-attn, else 16].")]
_CudaGraphsOpt = Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", help="CUDA: decode-only "
    "steps replay CUDA graphs captured at start for padded batch sizes [on; needs flash-attn].")]
_WindowRowsOpt = Annotated[int | None, typer.Option(help=WINDOW_ROWS_HELP)]
_LengthColumnOpt = Annotated[str | None, typer.Option(help=LENGTH_COLUMN_HELP)]
_SortByLengthOpt = Annotated[bool | None, typer.Option("--sort-by-length/--no-sort-by-length",
    help=SORT_HELP)]
_StaticMinOccupancyOpt = Annotated[float | None, typer.Option(help=OCCUPANCY_HELP)]
_DeviceOpt = Annotated[str | None, typer.Option(help="auto | cpu | cuda [auto].")]
_DtypeOpt = Annotated[str | None, typer.Option(help="auto | float32 | bfloat16 | float16 [auto].")]
_QuantizeOpt = Annotated[str | None, typer.Option(help="Weights: none | auto (a quantized GGUF's nearest) | int8 "
    "| int8-weight | int4 [none].")]
_QuantizeBackendOpt = Annotated[str | None, typer.Option(help="auto | torchao | quanto [auto].")]
_KvCacheDtypeOpt = Annotated[str | None, typer.Option(help="auto (model dtype) | int8 | fp8 [auto].")]
_OnLongPromptOpt = Annotated[str | None, typer.Option(help="truncate | error [truncate].")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"batchgen {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """batchgen pushes millions of prompts through a causal LM and never loses a row."""


@app.command()
def run(
    input: _InputOpt = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Output directory.")] = None,
    config: _ConfigOpt = None,
    model: _ModelOpt = None,
    trust_remote_code: _TrustRemoteCodeOpt = None,
    prompt_column: _PromptColumnOpt = None,
    id_column: Annotated[str | None, typer.Option(help="Column of unique row ids [derived: "
                         "file name + row index].")] = None,
    template: Annotated[str | None, typer.Option(help='Prompt template with {column} placeholders, '
                        'e.g. "Summarize:\\n\\n{text}".')] = None,
    system: _SystemOpt = None,
    chat: _ChatOpt = None,
    parse_special_tokens: _ParseSpecialTokensOpt = None,
    max_new_tokens: _MaxNewTokensOpt = None,
    max_new_tokens_column: _MaxNewTokensColumnOpt = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy [0].")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass [1.0].")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample from the k likeliest tokens [off].")] = None,
    seed: Annotated[int | None, typer.Option(help="Job seed; each row's seed derives from it and "
                    "the row id [0].")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeatable.")] = None,
    ignore_eos: Annotated[bool | None, typer.Option("--ignore-eos", help="Generate through EOS "
                          "(benchmarks).")] = None,
    batch_size: _BatchSizeOpt = None,
    max_num_batched_tokens: _MaxNumBatchedTokensOpt = None,
    kv_cache_memory: _KvCacheMemoryOpt = None,
    compile: _CompileOpt = None,
    attention_backend: _AttentionBackendOpt = None,
    block_size: _BlockSizeOpt = None,
    cuda_graphs: _CudaGraphsOpt = None,
    mode: _ModeOpt = None,
    window_rows: _WindowRowsOpt = None,
    length_column: _LengthColumnOpt = None,
    sort_by_length: _SortByLengthOpt = None,
    static_min_occupancy: _StaticMinOccupancyOpt = None,
    device: _DeviceOpt = None,
    dtype: _DtypeOpt = None,
    quantize: _QuantizeOpt = None,
    quantize_backend: _QuantizeBackendOpt = None,
    kv_cache_dtype: _KvCacheDtypeOpt = None,
    max_rows: Annotated[int | None, typer.Option(help="Process only the first N rows.")] = None,
    on_long_prompt: _OnLongPromptOpt = None,
    max_prompt_tokens: Annotated[int | None, typer.Option(help="Cut longer prompts (in their document "
                                 "part) to this many tokens [the context].")] = None,
    keep_columns: Annotated[list[str] | None, typer.Option(help="Input column to copy to the output; "
                            "repeatable [all].")] = None,
    max_error_rate: Annotated[float | None, typer.Option(help="Exit 3 when more than this fraction of "
                              "rows fail [off].")] = None,
    rows_per_part: Annotated[int | None, typer.Option(help="Rows per output part file [1000].")] = None,
    commit_every: Annotated[int | None, typer.Option("--commit-every", help="Commit finished rows after this "
                            "many, so a crash loses at most that much work [--rows-per-part].")] = None,
    commit_every_seconds: Annotated[float | None, typer.Option("--commit-every-seconds", help="Also commit "
                                    "finished rows this often; 0 = off [60].")] = None,
    stop_grace_seconds: Annotated[float | None, typer.Option("--stop-grace-seconds", help="On SIGTERM/SIGINT, "
                                  "exit within this many seconds: finished rows commit first, then rows in "
                                  "flight are checkpointed and continued on resume; 0 = no limit [25].")] = None,
    checkpoint_in_flight_every: Annotated[float | None, typer.Option(
        "--checkpoint-in-flight-every", help="Also checkpoint rows in flight this often (seconds), so even "
        "kill -9 loses at most that much of each row; 0 = off [off].")] = None,
    retry_errors: Annotated[bool | None, typer.Option("--retry-errors/--no-retry-errors", help="On resume, "
                            "generate committed error rows again [on].")] = None,
    overwrite: Annotated[bool | None, typer.Option("--overwrite", help="Drop what an earlier job committed "
                         "to --output and start over.")] = None,
    quiet: Annotated[bool | None, typer.Option("--quiet", "-q", help="No progress bar; a log line "
                     "every 30 s.")] = None,
) -> None:
    """Generate a completion for every input row and write Parquet parts to --output."""
    from batchgen.config import build_config
    from batchgen.jobs.run import run_job

    template = _template_flag(template)
    overrides = dict(
        inputs=input, output=output, model=model, trust_remote_code=trust_remote_code,
        prompt_column=prompt_column, id_column=id_column, template=template, system=system,
        chat=chat, parse_special_tokens=parse_special_tokens, max_new_tokens=max_new_tokens,
        max_new_tokens_column=max_new_tokens_column,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
        ignore_eos=ignore_eos, batch_size=batch_size, max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=kv_cache_memory, compile=compile, mode=mode, device=device, dtype=dtype, max_rows=max_rows,
        on_long_prompt=on_long_prompt, max_prompt_tokens=max_prompt_tokens, keep_columns=keep_columns,
        rows_per_part=rows_per_part, max_error_rate=max_error_rate, commit_every_rows=commit_every,
        commit_every_s=commit_every_seconds, stop_grace_s=stop_grace_seconds,
        checkpoint_in_flight_every_s=checkpoint_in_flight_every, retry_errors=retry_errors, overwrite=overwrite,
        quiet=quiet, window_rows=window_rows, length_column=length_column, sort_by_length=sort_by_length,
        static_min_occupancy=static_min_occupancy, quantize=quantize, quantize_backend=quantize_backend,
        kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend, block_size=block_size,
        cuda_graphs=cuda_graphs,
    )
    with _user_errors():
        job_config = build_config(config, **overrides)
        _setup_logging(job_config.quiet)
        summary = run_job(job_config)
    for line in summary.lines():
        typer.echo(line, err=True)
    typer.echo(json.dumps({"output": summary.output_dir, "rows": summary.num_rows,
                           "errors": summary.num_rows_error}))


@app.command()
def plan(
    input: _InputOpt = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="The job's output directory, if it "
                      "exists: only the rows a resume would run are planned, with its learned output lengths. "
                      "Nothing is written.")] = None,
    config: _ConfigOpt = None,
    model: _ModelOpt = None,
    trust_remote_code: _TrustRemoteCodeOpt = None,
    prompt_column: _PromptColumnOpt = None,
    id_column: Annotated[str | None, typer.Option(help="Column of unique row ids [derived].")] = None,
    template: Annotated[str | None, typer.Option(help="Prompt template with {column} placeholders.")] = None,
    system: _SystemOpt = None,
    chat: _ChatOpt = None,
    parse_special_tokens: _ParseSpecialTokensOpt = None,
    max_new_tokens: _MaxNewTokensOpt = None,
    max_new_tokens_column: _MaxNewTokensColumnOpt = None,
    ignore_eos: Annotated[bool | None, typer.Option("--ignore-eos", help="Generate through EOS "
                          "(benchmarks): every row's length is known.")] = None,
    batch_size: _BatchSizeOpt = None,
    max_num_batched_tokens: _MaxNumBatchedTokensOpt = None,
    kv_cache_memory: _KvCacheMemoryOpt = None,
    attention_backend: _AttentionBackendOpt = None,
    block_size: _BlockSizeOpt = None,
    mode: _ModeOpt = None,
    window_rows: _WindowRowsOpt = None,
    length_column: _LengthColumnOpt = None,
    sort_by_length: _SortByLengthOpt = None,
    static_min_occupancy: _StaticMinOccupancyOpt = None,
    device: _DeviceOpt = None,
    dtype: _DtypeOpt = None,
    quantize: _QuantizeOpt = None,
    quantize_backend: _QuantizeBackendOpt = None,
    kv_cache_dtype: _KvCacheDtypeOpt = None,
    max_rows: Annotated[int | None, typer.Option(help="Plan only the first N rows.")] = None,
    on_long_prompt: _OnLongPromptOpt = None,
    max_prompt_tokens: Annotated[int | None, typer.Option(help="Cut longer prompts to this many tokens "
                                 "[the context].")] = None,
    calibration_rows: Annotated[int, typer.Option(help="Rows of the first shard the calibration run "
                                "generates a few tokens for (0 = no calibration, no time estimate).")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Dry run: shards, prompt and predicted output lengths, mode per shard and why, KV memory, time."""
    from batchgen.config import build_config
    from batchgen.jobs.plan import plan_job, plan_lines

    overrides = dict(
        inputs=input, output=output, model=model, trust_remote_code=trust_remote_code,
        prompt_column=prompt_column, id_column=id_column, template=_template_flag(template), system=system,
        chat=chat, parse_special_tokens=parse_special_tokens, max_new_tokens=max_new_tokens,
        max_new_tokens_column=max_new_tokens_column,
        ignore_eos=ignore_eos, batch_size=batch_size, max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=kv_cache_memory, mode=mode, window_rows=window_rows, length_column=length_column,
        sort_by_length=sort_by_length, static_min_occupancy=static_min_occupancy, device=device, dtype=dtype,
        max_rows=max_rows, on_long_prompt=on_long_prompt, max_prompt_tokens=max_prompt_tokens,
        quantize=quantize, quantize_backend=quantize_backend, kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention_backend, block_size=block_size,
    )
    with _user_errors():
        job_config = build_config(config, need_output=False, **overrides)
        _setup_logging(quiet=True)
        report = plan_job(job_config, calibration_rows=calibration_rows)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for line in plan_lines(report):
            typer.echo(line)


@app.command()
def status(
    output: Annotated[str, typer.Option("--output", "-o", help="Output directory of a job.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object (for Airflow sensors and scripts).")]
    = False,
) -> None:
    """Rows done, errored and remaining per input shard, the config fingerprint, the last commit."""
    from batchgen.jobs.status import job_status, status_lines

    with _user_errors():
        result = job_status(output)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for line in status_lines(result):
            typer.echo(line)


@app.command()
def compact(
    output: Annotated[str, typer.Option("--output", "-o", help="Output directory of a finished job.")],
) -> None:
    """Rewrite a finished output directory as one part per input shard, rows in input order."""
    from batchgen.jobs.compact import compact_output

    with _user_errors():
        _setup_logging(quiet=False)
        result = compact_output(output)
    typer.echo(json.dumps({"output": result.output_dir, "parts_before": result.num_parts_before,
                           "parts_after": result.num_parts_after, "rows": result.num_rows}))


@app.command()
def bench(
    model: Annotated[str | None, typer.Option(help="HF model id, local dir or .gguf [embedded model].")] = None,
    num_requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 128,
    prompt_tokens: Annotated[int, typer.Option(help="Mean prompt length in tokens.")] = 128,
    output_tokens: Annotated[int, typer.Option(help="Mean output length in tokens (ignore-EOS).")] = 128,
    uniform: Annotated[bool, typer.Option("--uniform/--mixed", help="Equal lengths, or heavy-tailed "
                       "log-normal ones [mixed].")] = False,
    batch_size: Annotated[int, typer.Option(help="Sequences running at once.")] = 128,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget per engine step.")] = 2048,
    kv_cache_memory: Annotated[str | None, typer.Option(help="KV cache size, e.g. 2GiB [auto].")] = None,
    repeats: Annotated[int, typer.Option(help="Rounds; each policy runs once per round.")] = 2,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")] = "auto",
) -> None:
    """Measure engine throughput here: continuous against static batching, round-robin."""
    from batchgen.config import parse_bytes
    from batchgen.engine.loader import load_model
    from batchgen.jobs.bench import default_engine_configs, make_workload, run_bench

    with _user_errors():
        _setup_logging(quiet=True)
        loaded = load_model(model, device=device, dtype=dtype)
        workload = make_workload(num_requests, mean_prompt_tokens=prompt_tokens, mean_output_tokens=output_tokens,
                                 mixed=not uniform, vocab_size=len(loaded.tokenizer),
                                 max_tokens=loaded.max_context_tokens // 2)
        budget = parse_bytes(kv_cache_memory) if kv_cache_memory else None
        result = run_bench(loaded, workload, default_engine_configs(batch_size, max_num_batched_tokens, budget),
                           repeats)
    typer.echo(f"{loaded.name} {str(loaded.dtype).removeprefix('torch.')} on {loaded.device}: {num_requests} "
               f"requests, {workload.num_output_tokens} output tokens, {'uniform' if uniform else 'mixed'}", err=True)
    for name, r in result.items():
        typer.echo(f"{name:>10}: median {r['tokens_per_s_median']:.1f} tok/s, min {r['tokens_per_s_min']:.1f} "
                   f"({len(r['runs'])} runs)", err=True)
    typer.echo(json.dumps(result))


def _template_flag(template: str | None) -> str | None:
    # shells pass "\n" literally; a template flag is where users mean a newline
    return None if template is None else template.replace("\\n", "\n").replace("\\t", "\t")


class _user_errors:
    """Turn BatchgenError into one line on stderr and its exit code; Ctrl-C into 130."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            return False
        if issubclass(exc_type, BatchgenError):
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        if issubclass(exc_type, KeyboardInterrupt):
            typer.echo("interrupted", err=True)
            raise typer.Exit(code=130) from None
        return False


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is emitted, not as it was at set-up.

    basicConfig runs once per process; a handler bound to the first run's stderr breaks every later
    in-process run that swaps stderr (CliRunner, contextlib.redirect_stderr) with a closed stream.
    """

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _setup_logging(quiet: bool) -> None:
    level = os.environ.get("BATCHGEN_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, handlers=[_StderrHandler()], format="%(asctime)s %(levelname)s %(message)s")
    # transformers' own loading bars and notices are noise in a batch job's log
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main() -> None:
    omp.apply_defaults()  # before any command imports torch
    app()
