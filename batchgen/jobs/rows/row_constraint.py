"""A row's own constraint (--json-schema-column, --constraint-column) and the json_valid cell of a finished row.

Two columns, one per shape of cell. --json-schema-column holds a bare schema: the common case (a
mixed extraction job) stays a plain schema per row. --constraint-column holds a tagged object of
any kind, {"type": "regex", "pattern": ...}, {"type": "choices", "choices": [...]}, {"type":
"json_schema", "schema": ...} or {"type": "json_object"} (config/constraint.py's
Constraint.from_object), as OpenAI's response_format tags its kind: one column, and so one
constraint per row, rather than a column per kind whose cells could disagree. A job takes one of
the two columns; a null cell keeps the job's constraint.

A cell that is not such an object, or that no grammar can be built from, makes that row an error
row naming its file, row and column; the job goes on. Validity is judged on
the final text: parsed with json, then checked with jsonschema when a schema was given, so a row
cut short by max_new_tokens (finish_reason length) never passes as valid.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from batchgen.config.constraint import Constraint, ConstraintKind, InvalidConstraint
from batchgen.config.job import OPENAI_BATCH, JobConfig
from batchgen.engine.request import Completion, FinishReason
from batchgen.jobs.prompting.template import RowError
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.request_error import RequestError
from batchgen.jobs.rows.rows import InputRow


def row_constraint(row: InputRow, config: JobConfig) -> Constraint | None:
    """The row's own constraint, validated; None when neither column is set or the cell is null."""
    if config.json_schema_column is not None:
        column, what = config.json_schema_column, "a valid JSON schema"
    elif config.constraint_column is not None:
        column, what = config.constraint_column, "a valid constraint object"
    else:
        return None
    value = row.values.get(column)
    if value is None:
        return None
    try:
        if column == config.json_schema_column:
            return Constraint.json_schema(value).validate()
        return Constraint.from_object(_object(value)).validate()
    except InvalidConstraint as e:
        raise RowError(f"{where(row, column)} must hold {what}: {e}", column=column) from None


def check_compiles(planned: PlannedRow, config: JobConfig, compile_constraint: Callable[[Constraint], Any]) -> None:
    """Compile the row's own constraint against the model's tokenizer (the engine's grammar cache,
    so the engine reuses it): one that passed the tokenizer-free check but does not compile is that
    row's error row (a Batch API request's invalid_value error line), not an engine failure that
    would stop the job."""
    if planned.constraint is None:
        return
    try:
        compile_constraint(planned.constraint)
    except InvalidConstraint as e:
        if config.input_format == OPENAI_BATCH:
            raise RequestError("invalid_value", f"response_format does not compile for this model's tokenizer: {e}",
                               param="response_format") from None
        column = config.json_schema_column or config.constraint_column
        assert column is not None, "only a row's own constraint is checked here"
        raise RowError(f"{where(planned.row, column)} holds a constraint that does not compile for this model's "
                       f"tokenizer: {e}", column=column) from None


def where(row: InputRow, column: str) -> str:
    """The file, row and column of a cell, as its error row names them."""
    return f"{row.file.path} row {row.row_index}: column {column!r}"


def _object(value: Any) -> Any:
    """A constraint cell: JSON text, a struct (a dict) or an Arrow map (a list of key-value pairs)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidConstraint(f"not JSON: {e}") from None
    if isinstance(value, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        return dict(value)
    return value


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
