"""The output schema: the id column, the fixed result columns, then the passthrough input columns."""

from __future__ import annotations

import pyarrow as pa

# Fixed output columns, after the id column and before the passthrough input columns.
OUTPUT_FIXED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string()),  # one of FINISH_REASONS
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    pa.field("error", pa.string()),  # null when the row succeeded
)
FINISH_REASONS = ("stop", "length", "error")


def output_schema(id_field: pa.Field, passthrough: list[pa.Field]) -> pa.Schema:
    """The id field, then OUTPUT_FIXED_FIELDS, then the passthrough input columns in input order."""
    fields = [id_field, *OUTPUT_FIXED_FIELDS, *passthrough]
    names = [f.name for f in fields]
    # The CLI rejects colliding names with a usage error; reaching here with one is a bug.
    assert len(set(names)) == len(names), f"output column names collide: {names}"
    return pa.schema(fields)
