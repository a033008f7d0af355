"""A row's own constraint (--json-schema-column) and the json_valid cell of a finished row.

A per-row schema that is not JSON, or that no grammar can be built from, makes that row an error
row naming its column (the caller adds the file and row); the job goes on. Validity is judged on
the final text: parsed with json, then checked with jsonschema when a schema was given, so a row
cut short by max_new_tokens (finish_reason length) never passes as valid.
"""

from __future__ import annotations

import json

from batchgen.config.constraint import Constraint, ConstraintKind, InvalidConstraint
from batchgen.engine.request import Completion, FinishReason
from batchgen.jobs.pipeline.rows import InputRow
from batchgen.jobs.pipeline.template import RowError


def row_constraint(row: InputRow, column: str | None) -> Constraint | None:
    """The row's JSON-schema constraint, validated; None when the column is unset or the cell is null."""
    if column is None or row.values.get(column) is None:
        return None
    try:
        return Constraint.json_schema(row.values[column]).validate()
    except InvalidConstraint as e:
        raise RowError(f"{row.shard.path} row {row.row_index}: column {column!r} must hold a valid JSON schema: {e}",
                       column=column) from None


def json_valid(constraint: Constraint | None, completion: Completion) -> bool | None:
    """True when the text parses (and validates against the schema); None for a row without a JSON constraint."""
    if constraint is None or not constraint.is_json:
        return None
    if completion.finish_reason is not FinishReason.STOP:
        return False  # cut short: whatever parses so far is not the whole answer
    try:
        value = json.loads(completion.text)
    except json.JSONDecodeError:
        return False
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return isinstance(value, dict)
    import jsonschema  # only JSON-constrained jobs load it

    return jsonschema.Draft202012Validator(constraint.schema).is_valid(value)
