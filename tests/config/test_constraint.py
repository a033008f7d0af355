"""Constraint.from_object, the cell shape of --constraint-column: each kind, and each mistake a clear
InvalidConstraint."""

from __future__ import annotations

import pytest

from batchgen.config.constraint import Constraint, ConstraintKind, InvalidConstraint


def test_each_kind():
    assert Constraint.from_object({"type": "regex", "pattern": "[a-z]+"}) == Constraint.regex("[a-z]+")
    assert Constraint.from_object({"type": "choices", "choices": ["a", "b c"]}) == Constraint.choices(["a", "b c"])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert Constraint.from_object({"type": "json_schema", "schema": schema}) == Constraint.json_schema(schema)
    assert Constraint.from_object({"type": "json_object"}) == Constraint.json_object()
    # a struct cell has every field: the ones of other kinds are null
    cell = {"type": "regex", "pattern": "x+", "choices": None, "schema": None}
    assert Constraint.from_object(cell).kind is ConstraintKind.REGEX


@pytest.mark.parametrize(("value", "message"), [
    ("regex", "object with a type"),
    ({"pattern": "x"}, "type must be one of json_schema, json_object, regex, choices"),
    ({"type": "grammar", "lark": "start: x"}, "got 'grammar'"),
    ({"type": "regex"}, "needs 'pattern'"),
    ({"type": "regex", "pattern": "x", "choices": ["a"]}, "'choices' does not go with type 'regex'"),
    ({"type": "json_object", "schema": {}}, "it takes none"),
    ({"type": "choices", "choices": "a,b"}, "a list of strings"),
    ({"type": "choices", "choices": []}, "one or more non-empty strings"),
    ({"type": "json_schema", "schema": "{not json"}, "not JSON"),
])
def test_mistakes(value, message):
    with pytest.raises(InvalidConstraint, match=message):
        Constraint.from_object(value)
