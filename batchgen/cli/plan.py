"""`batchgen plan`: the dry run's flags (every one of `run`'s, and its own); the work is jobs/commands/plan.py's."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from batchgen.cli import options as o
from batchgen.cli.app import app
from batchgen.cli.console import setup_logging, user_errors
from batchgen.cli.help import PanelCommand


@app.command(cls=PanelCommand)
def plan(
    input: o.Input = None,
    input_format: o.InputFormat = None,
    output: Annotated[str | None, typer.Option("--output", "-o", metavar="DIR", rich_help_panel="Output", help=(
        "The job's output directory, if it exists: only the rows a resume would run are planned, with its "
        "learned output lengths. Nothing is written."))] = None,
    output_format: o.OutputFormat = None,
    config: o.Config = None,
    model: o.Model = None,
    trust_remote_code: o.TrustRemoteCode = None,
    lora: o.Lora = None,
    lora_column: o.LoraColumn = None,
    task: o.Task = None,
    pooling: o.Pooling = None,
    normalize: o.Normalize = None,
    dimensions: o.Dimensions = None,
    score_column: o.ScoreColumn = None,
    prompt_column: o.PromptColumn = None,
    id_column: o.IdColumn = None,
    template: o.Template = None,
    system: o.System = None,
    chat: o.Chat = None,
    chat_template: o.ChatTemplate = None,
    chat_template_kwargs: o.ChatTemplateKwargs = None,
    parse_special_tokens: o.ParseSpecialTokens = None,
    max_new_tokens: o.MaxNewTokens = None,
    max_new_tokens_column: o.MaxNewTokensColumn = None,
    temperature: o.Temperature = None,
    top_p: o.TopP = None,
    top_k: o.TopK = None,
    repetition_penalty: o.RepetitionPenalty = None,
    presence_penalty: o.PresencePenalty = None,
    frequency_penalty: o.FrequencyPenalty = None,
    min_tokens: o.MinTokens = None,
    sampling_column: o.SamplingColumn = None,
    min_p: o.MinP = None,
    n: o.N = None,
    logprobs: o.Logprobs = None,
    json_schema: o.JsonSchema = None,
    regex: o.Regex = None,
    choices: o.Choices = None,
    json_schema_column: o.JsonSchemaColumn = None,
    constraint_column: o.ConstraintColumn = None,
    stop_token_ids: o.StopTokenIds = None,
    logit_bias: o.LogitBias = None,
    allowed_token_ids: o.AllowedTokenIds = None,
    include_stop_str_in_output: o.IncludeStopStrInOutput = None,
    skip_special_tokens: o.SkipSpecialTokens = None,
    seed: o.Seed = None,
    stop: o.Stop = None,
    ignore_eos: o.IgnoreEos = None,
    batch_size: o.BatchSize = None,
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    kv_cache_memory: o.KvCacheMemory = None,
    compile: o.Compile = None,
    mode: o.Mode = None,
    window_rows: o.WindowRows = None,
    length_column: o.LengthColumn = None,
    sort_by_length: o.SortByLength = None,
    dedup: o.Dedup = None,
    prefix_order: o.PrefixOrder = None,
    jump_forward: o.JumpForward = None,
    static_min_occupancy: o.StaticMinOccupancy = None,
    device: o.Device = None,
    dtype: o.Dtype = None,
    quantize: o.Quantize = None,
    quantize_backend: o.QuantizeBackend = None,
    quantize_embedding: o.QuantizeEmbedding = None,
    kv_cache_dtype: o.KvCacheDtype = None,
    attention_backend: o.AttentionBackend = None,
    block_size: o.BlockSize = None,
    cuda_graphs: o.CudaGraphs = None,
    max_rows: o.MaxRows = None,
    num_shards: o.NumShards = None,
    shard_index: o.ShardIndex = None,
    on_long_prompt: o.OnLongPrompt = None,
    max_prompt_tokens: o.MaxPromptTokens = None,
    keep_columns: o.KeepColumns = None,
    max_error_rate: o.MaxErrorRate = None,
    allow_empty_input: o.AllowEmptyInput = None,
    rows_per_part: o.RowsPerPart = None,
    commit_every: o.CommitEvery = None,
    commit_every_seconds: o.CommitEverySeconds = None,
    stop_grace_seconds: o.StopGraceSeconds = None,
    checkpoint_in_flight_every: o.CheckpointInFlightEvery = None,
    retry_errors: o.RetryErrors = None,
    overwrite: o.Overwrite = None,
    quiet: o.Quiet = None,
    metrics: o.Metrics = None,
    metrics_textfile: o.MetricsTextfile = None,
    metrics_port: o.MetricsPort = None,
    metrics_host: o.MetricsHost = None,
    metrics_every_seconds: o.MetricsEverySeconds = None,
    executor: o.Executor = None,
    ray_actors: o.RayActors = None,
    ray_keep_warm: o.RayKeepWarm = None,
    workers: o.Workers = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", rich_help_panel="Plan", help=(
        "Measure this machine: a short calibration run generates a few tokens for rows of the first shard and "
        "stores the step costs for later plans of the same setup. Without it the time comes from the stored "
        "profile, else the built-in CPU one (rough), and nothing is generated."))] = False,
    calibration_rows: Annotated[int | None, typer.Option(metavar="N", rich_help_panel="Plan", help=(
        "Rows the calibration runs on; N > 0 implies --calibrate, 0 turns it off [16]."))] = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel="Plan", help="One JSON object on stdout.")] = False,
) -> None:
    """Dry run: shards, prompt and predicted output lengths, mode per shard and why, KV memory, time, output size.

    Loads the model and tokenizes every prompt; generates nothing unless --calibrate.

    Takes every `run` option, so a run command pasted here plans that job; those that do not change
    the plan (sampling, commits, metrics, executor) are checked as a run checks them, then ignored."""
    params = dict(locals())
    with user_errors():  # config_overrides reads escapes in --stop/--template, which can be malformed
        overrides = o.config_overrides(params)
        from batchgen.config.job import build_config
        from batchgen.jobs.commands.plan import plan_job, plan_lines  # imports torch only once the checks have passed

        job_config = build_config(config, need_output=False, **overrides)
        setup_logging(quiet=True)
        report = plan_job(job_config, calibrate=calibrate if calibration_rows is None else calibration_rows > 0,
                          calibration_rows=calibration_rows or 16)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for line in plan_lines(report):
            typer.echo(line)
