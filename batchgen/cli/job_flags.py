"""The flags `run` and `plan` share, listed once in `run`'s --help order, and the decorator that gives a
command every one of them: a new job option is an alias in cli/options.py and its line here, never two
signatures to keep in step (a pasted `run` command must plan)."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

from batchgen.cli import options as o

# parameter name -> its option; within each --help section (options.PANEL_OF) the options appear in this order
JOB_FLAGS: dict[str, Any] = dict(
    input=o.Input, input_format=o.InputFormat, output=o.Output, output_format=o.OutputFormat, config=o.Config,
    model=o.Model, trust_remote_code=o.TrustRemoteCode, lora=o.Lora, lora_column=o.LoraColumn, task=o.Task,
    pooling=o.Pooling, normalize=o.Normalize, dimensions=o.Dimensions, score_column=o.ScoreColumn,
    prompt_column=o.PromptColumn, id_column=o.IdColumn, template=o.Template, system=o.System, chat=o.Chat,
    chat_template=o.ChatTemplate, chat_template_kwargs=o.ChatTemplateKwargs,
    parse_special_tokens=o.ParseSpecialTokens, max_new_tokens=o.MaxNewTokens,
    max_new_tokens_column=o.MaxNewTokensColumn, temperature=o.Temperature, top_p=o.TopP, top_k=o.TopK,
    repetition_penalty=o.RepetitionPenalty, presence_penalty=o.PresencePenalty,
    frequency_penalty=o.FrequencyPenalty, min_tokens=o.MinTokens, sampling_column=o.SamplingColumn, min_p=o.MinP,
    n=o.N, logprobs=o.Logprobs, json_schema=o.JsonSchema, regex=o.Regex, choices=o.Choices,
    json_schema_column=o.JsonSchemaColumn, constraint_column=o.ConstraintColumn, stop_token_ids=o.StopTokenIds,
    logit_bias=o.LogitBias, allowed_token_ids=o.AllowedTokenIds,
    include_stop_str_in_output=o.IncludeStopStrInOutput, skip_special_tokens=o.SkipSpecialTokens, seed=o.Seed,
    stop=o.Stop, ignore_eos=o.IgnoreEos, batch_size=o.BatchSize, max_num_batched_tokens=o.MaxNumBatchedTokens,
    kv_cache_memory=o.KvCacheMemory, compile=o.Compile, mode=o.Mode, window_rows=o.WindowRows,
    length_column=o.LengthColumn, sort_by_length=o.SortByLength, dedup=o.Dedup, prefix_order=o.PrefixOrder,
    jump_forward=o.JumpForward, static_min_occupancy=o.StaticMinOccupancy, device=o.Device, dtype=o.Dtype,
    quantize=o.Quantize, quantize_backend=o.QuantizeBackend, quantize_embedding=o.QuantizeEmbedding,
    kv_cache_dtype=o.KvCacheDtype, attention_backend=o.AttentionBackend, block_size=o.BlockSize,
    cuda_graphs=o.CudaGraphs, max_rows=o.MaxRows, num_shards=o.NumShards, shard_index=o.ShardIndex,
    on_long_prompt=o.OnLongPrompt, max_prompt_tokens=o.MaxPromptTokens, keep_columns=o.KeepColumns,
    max_error_rate=o.MaxErrorRate, allow_empty_input=o.AllowEmptyInput, rows_per_part=o.RowsPerPart,
    commit_every=o.CommitEvery, commit_every_seconds=o.CommitEverySeconds, stop_grace_seconds=o.StopGraceSeconds,
    checkpoint_in_flight_every=o.CheckpointInFlightEvery, retry_errors=o.RetryErrors, overwrite=o.Overwrite,
    quiet=o.Quiet, metrics=o.Metrics, metrics_textfile=o.MetricsTextfile, metrics_port=o.MetricsPort,
    metrics_host=o.MetricsHost, metrics_every_seconds=o.MetricsEverySeconds, executor=o.Executor,
    ray_actors=o.RayActors, ray_keep_warm=o.RayKeepWarm, workers=o.Workers
)


def job_command(**replaced: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give `command(own flags..., **job)` every job flag as a parameter Typer reads, then its own.

    `replaced` declares a job flag anew for this command (plan's --output, which writes nothing); its value
    still arrives in `job`, as every job flag's does."""
    assert set(replaced) <= set(JOB_FLAGS), set(replaced) - set(JOB_FLAGS)

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        hints = typing.get_type_hints(command, include_extras=True)  # its own flags' Annotated options
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter(name, kind, default=None, annotation=replaced.get(name, option))
                  for name, option in JOB_FLAGS.items()]
        params += [inspect.Parameter(name, kind, default=p.default, annotation=hints[name])
                   for name, p in inspect.signature(command).parameters.items() if p.kind is not p.VAR_KEYWORD]
        assert not set(JOB_FLAGS) & {p.name for p in params[len(JOB_FLAGS):]}, "a job flag declared twice"

        @functools.wraps(command)
        def with_job_flags(**values: Any) -> None:
            return command(**values)

        with_job_flags.__signature__ = inspect.Signature(params)  # what Typer reads, with the annotations below
        with_job_flags.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
        return with_job_flags

    return decorate
