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


def output_schema(id_field: pa.Field, passthrough: list[pa.Field], *, with_prompt_hash: bool = True,
                  with_prompt_truncated: bool = True, with_logprobs: bool = False) -> pa.Schema:
    """The id field, then OUTPUT_FIXED_FIELDS, then the passthrough input columns in input order.

    `with_prompt_hash=False` / `with_prompt_truncated=False`: the schema of directories begun
    before that column, which keep it so that their parts stay one table."""
    dropped = {name for name, keep in ((PROMPT_HASH, with_prompt_hash), (PROMPT_TRUNCATED, with_prompt_truncated))
               if not keep}
    fixed = [f for f in OUTPUT_FIXED_FIELDS if f.name not in dropped]
    fields = [id_field, *fixed, *([LOGPROBS_FIELD] if with_logprobs else []), *passthrough]
    names = [f.name for f in fields]
    # The CLI rejects colliding names with a usage error; reaching here with one is a bug.
    assert len(set(names)) == len(names), f"output column names collide: {names}"
    return pa.schema(fields)
