"""`batchgen run`: parse the flags, then hand the job to batchgen.jobs.commands.run.

Everything a user can get wrong (flags, config file, inputs, columns, template, output directory)
is checked before torch and transformers are imported, which alone takes seconds.
"""

from __future__ import annotations

import json

import typer

from batchgen.cli import options as o
from batchgen.cli.app import app
from batchgen.cli.console import setup_logging, user_errors
from batchgen.cli.help import PanelCommand


@app.command(cls=PanelCommand)
def run(
    input: o.Input = None,
    input_format: o.InputFormat = None,
    output: o.Output = None,
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
) -> None:
    """Generate a completion for every input row and write Parquet parts to --output."""
    params = dict(locals())
    with user_errors():  # config_overrides reads escapes in --stop/--template, which can be malformed
        overrides = o.config_overrides(params)
        from batchgen.config.job import build_config
        from batchgen.jobs.commands.run import run_job  # imports torch only once the job's checks have passed

        job_config = build_config(config, **overrides)
        setup_logging(job_config.quiet)
        workers = job_config.workers  # the flag, else the config file's `workers:`
        if workers is not None and workers > 1:
            from batchgen.jobs.executors.workers import run_workers

            result = run_workers(job_config, workers)
            typer.echo(f"done: {result['rows']} rows ({result['rows_error']} errors) by {workers} workers, "
                       f"finalized in {result['output']}", err=True)
            typer.echo(json.dumps({"output": result["output"], "rows": result["rows_run"],
                                   "errors": result["rows_error_run"],
                                   "output_rows": result["rows"], "output_errors": result["rows_error"],
                                   "workers": workers}))
            return
        summary = run_job(job_config)
    for line in summary.lines():
        typer.echo(line, err=True)
    typer.echo(json.dumps({"output": summary.output_dir, "rows": summary.num_rows, "errors": summary.num_rows_error,
                           "output_rows": summary.output_rows, "output_errors": summary.output_rows_error}))
