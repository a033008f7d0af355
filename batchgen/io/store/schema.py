"""The output schema: the id column, the fixed result columns, then the passthrough input columns."""

from __future__ import annotations

import pyarrow as pa

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


def output_schema(id_field: pa.Field, passthrough: list[pa.Field], *, with_prompt_hash: bool = True,
                  with_prompt_truncated: bool = True, with_logprobs: bool = False,
                  with_json_valid: bool = False, with_sample_index: bool = False,
                  with_adapter: bool = False) -> pa.Schema:
    """The id field, then OUTPUT_FIXED_FIELDS, then the passthrough input columns in input order.

    `with_prompt_hash=False` / `with_prompt_truncated=False`: the schema of directories begun
    before that column, which keep it so that their parts stay one table."""
    dropped = {name for name, keep in ((PROMPT_HASH, with_prompt_hash), (PROMPT_TRUNCATED, with_prompt_truncated))
               if not keep}
    fixed = [f for f in OUTPUT_FIXED_FIELDS if f.name not in dropped]
    fields = [id_field, *([SAMPLE_INDEX_FIELD] if with_sample_index else []), *fixed,
              *([LOGPROBS_FIELD] if with_logprobs else []), *([JSON_VALID_FIELD] if with_json_valid else []),
              *([ADAPTER_FIELD] if with_adapter else []), *passthrough]
    names = [f.name for f in fields]
    # The CLI rejects colliding names with a usage error; reaching here with one is a bug.
    assert len(set(names)) == len(names), f"output column names collide: {names}"
    return pa.schema(fields)
