"""response_format -> the row's constraint: text, json_object and json_schema (strict or not); a format
batchgen cannot build a grammar for is that request's invalid_value error."""

from __future__ import annotations

import json

import pytest

from batchgen.config.constraint import Constraint
from batchgen.jobs.openai.response_format import response_format_constraint
from batchgen.jobs.rows.request_error import RequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("value, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, Constraint.json_object()),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
     Constraint.json_schema(SCHEMA)),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False, "description": "d"}},
     Constraint.json_schema(SCHEMA)),
])
def test_formats_map_to_constraints(value, expected):
    assert response_format_constraint(value) == expected


@pytest.mark.parametrize("value, param", [
    ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_object", "json_schema": {}}, "response_format"),
])
def test_bad_formats_are_the_requests_error(value, param):
    with pytest.raises(RequestError) as e:
        response_format_constraint(value)
    message = str(e.value)
    assert message.startswith("invalid_value") and json.dumps(param)[1:-1] in message, message
