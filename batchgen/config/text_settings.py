"""Settings given as text that must be read or parsed before any load: the chat template (a file or
Jinja text) and its kwargs, and the output constraint (--json-schema, --regex, --choices and the
per-row constraint columns). config/rules.py calls these while validating a JobConfig.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.config.constraint import InvalidConstraint, job_constraint
from batchgen.config.keys import label
from batchgen.errors import ConfigError

if TYPE_CHECKING:
    from batchgen.config.job import JobConfig

RESERVED_CHAT_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "chat_template", "add_generation_prompt",
                                           "tokenize", "tools", "documents"})


def chat_template_text(value: str) -> str:
    """--chat-template's Jinja text: the file it names, or (as vLLM reads it) the text itself when
    it holds template syntax; ConfigError for a file that is not there."""
    if _is_jinja(value):
        return value
    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{label('chat_template')}: cannot read {value!r} ({e.__class__.__name__}): pass a "
                          "Jinja template file") from None
    if not _is_jinja(text):
        raise ConfigError(f"{label('chat_template')}: {value} holds no Jinja ({{{{ }}}} or {{% %}}), so it would "
                          "render no message")
    return text


def _is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def chat_template_settings(config: JobConfig) -> None:
    """Read the --chat-template file and parse --chat-template-kwargs now, before any load."""
    if config.chat_template is not None:
        if not isinstance(config.chat_template, str) or not config.chat_template:
            raise ConfigError(f"{label('chat_template')} must be a file path, got {config.chat_template!r}")
        # the text from here on: Ray actors and --workers processes need no access to the file
        config.chat_template = chat_template_text(config.chat_template)
    kwargs = config.chat_template_kwargs
    if isinstance(kwargs, str):  # the flag's JSON
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{label('chat_template_kwargs')}: not valid JSON: {e}") from None
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ConfigError(f"{label('chat_template_kwargs')} must be a JSON object, e.g. "
                          f"'{{\"enable_thinking\": false}}'; got {config.chat_template_kwargs!r}")
    if kwargs is not None and set(kwargs) & RESERVED_CHAT_TEMPLATE_KWARGS:
        raise ConfigError(f"{label('chat_template_kwargs')}: {sorted(set(kwargs) & RESERVED_CHAT_TEMPLATE_KWARGS)} "
                          "are set by batchgen itself")
    config.chat_template_kwargs = kwargs or None
    if config.chat is False and (config.chat_template is not None or config.chat_template_kwargs):
        raise ConfigError("--chat-template and --chat-template-kwargs need the chat template, and --no-chat turns "
                          "it off: drop one of them")


def constraint_settings(config: JobConfig) -> None:
    """Parse and check --json-schema / --regex / --choices now (exit 2 before any load); the job's
    Constraint is then config/constraint.py's job_constraint(config)."""
    given = [name for name in ("json_schema", "regex", "choices") if getattr(config, name) is not None]
    if len(given) > 1:
        raise ConfigError(f"{label(given[0])} and {label(given[1])} cannot go together: a row has one constraint")
    if isinstance(config.choices, str):  # the flag's "a,b,c"
        config.choices = [c.strip() for c in config.choices.split(",") if c.strip()]
    if config.choices is not None and config.min_tokens:
        # the grammar ends a row once its text is a whole choice, so min_tokens would silently not apply
        raise ConfigError(f"{label('choices')} and {label('min_tokens')} cannot go together: a row ends as soon as "
                          "its text is one of the choices, however few tokens that is; drop --min-tokens")
    if isinstance(config.json_schema, str):
        config.json_schema = _schema_value(config.json_schema)
    for name in ("json_schema_column", "constraint_column"):
        column = getattr(config, name)
        if column is not None and (not isinstance(column, str) or not column):
            raise ConfigError(f"{label(name)} must be a column name, got {column!r}")
    if config.json_schema_column is not None and config.constraint_column is not None:
        raise ConfigError(f"{label('json_schema_column')} and {label('constraint_column')} cannot go together: "
                          "a row has one constraint (a constraint cell can hold a schema: "
                          '{"type": "json_schema", "schema": ...})')
    if given:
        try:
            job_constraint(config).validate()
        except InvalidConstraint as e:
            raise ConfigError(f"{label(given[0])}: {e}") from None


def _schema_value(text: str) -> Any:
    """--json-schema's value: inline JSON, or a file holding it."""
    if not text.lstrip().startswith(("{", "[")):
        try:
            text = Path(text).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{label('json_schema')}: cannot read {text!r} ({e.__class__.__name__}): pass a "
                              "JSON schema file or inline JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{label('json_schema')}: not valid JSON: {e}") from None
