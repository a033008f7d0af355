"""A Batch API request's `response_format` -> the row's structured-output constraint.

    {"type": "text"}                                   no constraint
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                                                       JSON valid against `schema`

Decoding is always constrained, so `strict` false is accepted and means the same as true (the API
only promises schema adherence with strict true; batchgen gives it in both cases). A format
batchgen cannot build a grammar for is that request's error (invalid_value), as the API answers.
"""

from __future__ import annotations

from typing import Any

from batchgen.config.constraint import Constraint, InvalidConstraint
from batchgen.jobs.rows.request_error import RequestError

PARAM = "response_format"
SCHEMA_FIELDS = {"name", "schema", "strict", "description"}


def response_format_constraint(value: Any) -> Constraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError("invalid_value", "response_format must be an object with a type", param=PARAM)
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or ("json_schema" in value and kind != "json_schema"):
        raise RequestError("invalid_value", f"response_format field {(extra or ['json_schema'])[0]!r} is not "
                           f"expected with type {kind!r}", param=PARAM)
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise RequestError("invalid_value", f"response_format type {kind!r} is not supported (text, json_object, "
                           "json_schema)", param=f"{PARAM}.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError("invalid_value", "response_format json_schema must be an object with a name",
                           param=f"{PARAM}.json_schema")
    unknown = sorted(set(spec) - SCHEMA_FIELDS)
    if unknown:
        raise RequestError("invalid_value", f"response_format json_schema field {unknown[0]!r} is not supported",
                           param=f"{PARAM}.json_schema")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise RequestError("invalid_value", "response_format json_schema strict must be true or false",
                           param=f"{PARAM}.json_schema.strict")
    try:
        # no schema: any JSON value, as the API reads a json_schema without one
        return Constraint.json_schema(spec.get("schema", {})).validate()
    except InvalidConstraint as e:
        raise RequestError("invalid_value", f"response_format json_schema: {e}",
                           param=f"{PARAM}.json_schema.schema") from None
