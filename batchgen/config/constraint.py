"""A structured-output constraint: what a row's text must match (JSON schema, JSON object, regex, choices).

Plain, hashable data so that SamplingParams stays frozen and the engine can cache one compiled
grammar per constraint. It lives in config/ (not engine/) because a job-level constraint is checked
before the model loads; llguidance validates a grammar without a tokenizer and imports no torch.
Compiling against a tokenizer and masking logits are the engine's (engine/sampling/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

# compact JSON: with flexible whitespace a small model can emit blank space until max_new_tokens
_JSON_LAYOUT = {"whitespace_flexible": False}


class ConstraintKind(str, Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"
    CHOICES = "choices"


class InvalidConstraint(ValueError):
    """A schema, regex or choice list that no grammar can be built from; callers name the flag or row."""


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    # json_schema: the schema as compact JSON (keys in the user's order: a schema's property order is the
    # output's, so sorting them would reorder every row's fields);
    # regex: the pattern; choices: a JSON list of the strings; json_object: ""
    spec: str

    @staticmethod
    def json_schema(schema: Any) -> Constraint:
        """From a parsed schema (dict or bool) or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidConstraint(f"not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidConstraint(f"a JSON schema is an object, got {type(schema).__name__}")
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @staticmethod
    def json_object() -> Constraint:
        return Constraint(ConstraintKind.JSON_OBJECT, "")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidConstraint("a regex is a non-empty string")
        return Constraint(ConstraintKind.REGEX, pattern)

    @staticmethod
    def choices(options: list[str] | tuple[str, ...]) -> Constraint:
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidConstraint(f"choices are one or more non-empty strings, got {options!r}")
        return Constraint(ConstraintKind.CHOICES, json.dumps(options))

    @property
    def is_json(self) -> bool:
        """The output is JSON (a json_valid column is meaningful)."""
        return self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT)

    @property
    def schema(self) -> Any:
        """The parsed schema (json_schema only)."""
        assert self.kind is ConstraintKind.JSON_SCHEMA
        return json.loads(self.spec)

    def grammar(self) -> str:
        """The llguidance grammar text (raises InvalidConstraint when it cannot be built)."""
        import llguidance  # no torch; only constrained jobs pay for it

        kind = self.kind
        if kind is ConstraintKind.JSON_SCHEMA:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=_JSON_LAYOUT)
            except Exception as e:  # a schema llguidance cannot even parse (e.g. a bad $ref)
                raise InvalidConstraint(str(e).strip().splitlines()[0]) from None
        elif kind is ConstraintKind.JSON_OBJECT:
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=_JSON_LAYOUT)
        elif kind is ConstraintKind.REGEX:
            grammar = llguidance.LLMatcher.grammar_from_regex(self.spec)
        else:
            # a lark alternation of JSON-quoted literals: any character in a choice is literal
            grammar = "start: " + " | ".join(json.dumps(o) for o in json.loads(self.spec))
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidConstraint(error.strip().splitlines()[0] if kind is not ConstraintKind.REGEX
                                    else " ".join(error.split())[:300])
        return grammar

    @staticmethod
    def from_object(value: Any) -> Constraint:
        """From a tagged object, the cell shape of --constraint-column (OpenAI response_format's
        "type" key, the spec beside it): {"type": "json_schema", "schema": {...}}, {"type":
        "json_object"}, {"type": "regex", "pattern": "..."}, {"type": "choices", "choices": [...]}.
        Keys that are null count as absent (an Arrow struct cell has every field)."""
        if not isinstance(value, dict):
            raise InvalidConstraint(f"a constraint is an object with a type, got {type(value).__name__}")
        value = {k: v for k, v in value.items() if v is not None}
        kind = value.pop("type", None)
        try:
            kind = ConstraintKind(kind)
        except ValueError:
            known = ", ".join(k.value for k in ConstraintKind)
            raise InvalidConstraint(f"type must be one of {known}, got {kind!r}") from None
        key = {ConstraintKind.JSON_SCHEMA: "schema", ConstraintKind.REGEX: "pattern",
               ConstraintKind.CHOICES: "choices", ConstraintKind.JSON_OBJECT: None}[kind]
        extra = sorted(set(value) - {key})
        if extra:
            raise InvalidConstraint(f"key {extra[0]!r} does not go with type {kind.value!r}"
                                    + (f" (it takes {key!r})" if key else " (it takes none)"))
        if key is not None and key not in value:
            raise InvalidConstraint(f"type {kind.value!r} needs {key!r}")
        if kind is ConstraintKind.JSON_SCHEMA:
            return Constraint.json_schema(value[key])
        if kind is ConstraintKind.REGEX:
            return Constraint.regex(value[key])
        if kind is ConstraintKind.CHOICES:
            if not isinstance(value[key], (list, tuple)):
                raise InvalidConstraint(f"choices are a list of strings, got {type(value[key]).__name__}")
            return Constraint.choices(value[key])
        return Constraint.json_object()

    def validate(self) -> Constraint:
        """Raise InvalidConstraint if no grammar can be built; return self for chaining."""
        self.grammar()
        return self

    def describe(self) -> str:
        """A short stable text of the constraint (fingerprints, logs)."""
        return f"{self.kind.value}:{self.spec}"


def job_constraint(config: Any) -> Constraint | None:
    """The constraint a JobConfig's --json-schema / --regex / --choices set (after validation), or None."""
    if config.json_schema is not None:
        return Constraint.json_schema(config.json_schema)
    if config.regex is not None:
        return Constraint.regex(config.regex)
    if config.choices is not None:
        return Constraint.choices(config.choices)
    return None


def writes_json_valid(config: Any) -> bool:
    """A job whose rows may carry a JSON constraint writes the json_valid column: an OpenAI Batch
    job too, whose requests may carry a JSON response_format (jobs/commands/run.py leaves it out of
    a directory begun before the column, so that its parts stay one table)."""
    constraint = job_constraint(config)
    return (config.json_schema_column is not None or config.constraint_column is not None
            or config.input_format == "openai-batch"  # rules.OPENAI_BATCH (rules imports this module)
            or (constraint is not None and constraint.is_json))
