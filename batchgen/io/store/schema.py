"""The output schema: the id column, the fixed result columns, then the passthrough input columns."""

from __future__ import annotations

import pyarrow as pa

PROMPT_HASH = "prompt_hash"
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
)
FINISH_REASONS = ("stop", "length", "error")


def output_schema(id_field: pa.Field, passthrough: list[pa.Field], *, with_prompt_hash: bool = True) -> pa.Schema:
    """The id field, then OUTPUT_FIXED_FIELDS, then the passthrough input columns in input order.

    `with_prompt_hash=False`: the schema of directories begun before the prompt_hash column, which
    keep it so that their parts stay one table."""
    fixed = [f for f in OUTPUT_FIXED_FIELDS if with_prompt_hash or f.name != PROMPT_HASH]
    fields = [id_field, *fixed, *passthrough]
    names = [f.name for f in fields]
    # The CLI rejects colliding names with a usage error; reaching here with one is a bug.
    assert len(set(names)) == len(names), f"output column names collide: {names}"
    return pa.schema(fields)
