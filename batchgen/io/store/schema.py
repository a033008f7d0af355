"""The output schema: the id column, the fixed result columns, then the passthrough input columns."""

from __future__ import annotations

import pyarrow as pa

from batchgen.config.choices import Task

PROMPT_HASH = "prompt_hash"
PROMPT_TRUNCATED = "prompt_truncated"
# Fixed output columns, after the id column and before the passthrough input columns.
OUTPUT_FIXED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string()),  # one of FINISH_REASONS
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    pa.field("error", pa.string()),  # null when the row succeeded
    # blake2b-64 of the prompt token ids the row was generated from (null for error rows): under
    # --id-column a resume regenerates a committed row whose prompt hash changed
    pa.field(PROMPT_HASH, pa.string()),
    # true when the prompt was cut to fit the context or --max-prompt-tokens (--on-long-prompt
    # truncate); null for error rows
    pa.field(PROMPT_TRUNCATED, pa.bool_()),
)
FINISH_REASONS = ("stop", "length", "error")
GENERATED_FIELDS = ("generated_text", "finish_reason", "num_generated_tokens")  # generate's own columns

EMBEDDING = "embedding"
# --task score and classify: their own columns, in place of generate's; embed's (a vector of the
# model's size, so known only once its files are read) is embedding_field's
SCORE_FIELDS: tuple[pa.Field, ...] = (
    pa.field("logprob", pa.float64()),  # the sum of the scored tokens' log-probabilities (natural log)
    pa.field("num_scored_tokens", pa.int32()),
    pa.field("perplexity", pa.float64()),  # exp(-logprob / num_scored_tokens); null when nothing was scored
)
CLASSIFY_FIELDS: tuple[pa.Field, ...] = (
    pa.field("label", pa.string()),  # the model's id2label of the argmax; null for a regression head
    pa.field("scores", pa.list_(pa.float32())),  # softmax over the labels, or the raw value(s) of a regression head
)

LOGPROBS = "logprobs"
_TOKEN_LOGPROB = [pa.field("token", pa.string()), pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())]
# --logprobs K: per generated token, its text, id and logprob, and its K likeliest alternatives
# (fewer where the truncation left fewer); null for error rows. After the fixed columns.
LOGPROBS_FIELD = pa.field(LOGPROBS, pa.list_(pa.struct(
    [*_TOKEN_LOGPROB, pa.field("top_logprobs", pa.list_(pa.struct(_TOKEN_LOGPROB)))])))

SAMPLE_INDEX = "sample_index"
# jobs in which a row may ask for several samples (--n > 1, a --sampling-column, OpenAI Batch requests):
# one output row per sample, keyed by (id, sample_index), 0..n-1; null for error rows (one per input row).
# Right after the id column, so (id, sample_index) read as the key. Every other job keeps its schema.
SAMPLE_INDEX_FIELD = pa.field(SAMPLE_INDEX, pa.int32())

JSON_VALID = "json_valid"
# a JSON-constrained job (--json-schema, --json-schema-column): the text parsed (and validated against
# the row's schema); null for error rows and rows without a JSON constraint. After the fixed columns,
# only in such jobs, so the outputs of every other job keep their schema.
JSON_VALID_FIELD = pa.field(JSON_VALID, pa.bool_())

ADAPTER = "adapter"
# a job with --lora: the adapter that produced the row (null: the base model, and error rows). After
# the fixed columns, only in such jobs.
ADAPTER_FIELD = pa.field(ADAPTER, pa.string())


def embedding_field(embedding_dim: int) -> pa.Field:
    """--task embed's vector column: fixed-size, so readers (Arrow, Polars, vector stores) get a dense
    [rows, dim] array without per-row offsets; null for error rows."""
    assert isinstance(embedding_dim, int) and embedding_dim >= 1, embedding_dim
    return pa.field(EMBEDDING, pa.list_(pa.field("item", pa.float32()), embedding_dim))


def task_fixed_fields(task: Task | str, embedding_dim: int | None = None) -> list[pa.Field]:
    """The fixed columns of a task's output: generate's OUTPUT_FIXED_FIELDS; for the one-forward tasks
    their own columns, then what every row has (num_prompt_tokens, error, prompt_hash, prompt_truncated)."""
    task = Task(task)
    if task == Task.GENERATE:
        return list(OUTPUT_FIXED_FIELDS)
    own = {Task.SCORE: SCORE_FIELDS, Task.CLASSIFY: CLASSIFY_FIELDS}.get(task)
    if own is None:
        assert embedding_dim is not None, "an embed job's schema needs the model's embedding size"
        own = (embedding_field(embedding_dim),)
    return [*own, *(f for f in OUTPUT_FIXED_FIELDS if f.name not in GENERATED_FIELDS)]


def output_schema(id_field: pa.Field, passthrough: list[pa.Field], *, with_prompt_hash: bool = True,
                  with_prompt_truncated: bool = True, with_logprobs: bool = False,
                  with_json_valid: bool = False, with_sample_index: bool = False,
                  with_adapter: bool = False, task: Task | str = Task.GENERATE,
                  embedding_dim: int | None = None) -> pa.Schema:
    """The id field, then the task's fixed fields (task_fixed_fields), then the passthrough input
    columns in input order. `embedding_dim`: an embed job's vector size (after --dimensions).

    `with_prompt_hash=False` / `with_prompt_truncated=False`: the schema of directories begun
    before that column, which keep it so that their parts stay one table."""
    # logprobs and json_valid describe generated tokens: the config refuses them with the other tasks
    assert Task(task) == Task.GENERATE or not (with_logprobs or with_json_valid), task
    dropped = {name for name, keep in ((PROMPT_HASH, with_prompt_hash), (PROMPT_TRUNCATED, with_prompt_truncated))
               if not keep}
    fixed = [f for f in task_fixed_fields(task, embedding_dim) if f.name not in dropped]
    fields = [id_field, *([SAMPLE_INDEX_FIELD] if with_sample_index else []), *fixed,
              *([LOGPROBS_FIELD] if with_logprobs else []), *([JSON_VALID_FIELD] if with_json_valid else []),
              *([ADAPTER_FIELD] if with_adapter else []), *passthrough]
    names = [f.name for f in fields]
    # The CLI rejects colliding names with a usage error; reaching here with one is a bug.
    assert len(set(names)) == len(names), f"output column names collide: {names}"
    return pa.schema(fields)
