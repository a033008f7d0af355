"""Prompt templates: `{column}` placeholders filled from a row, parsed here, never by str.format.

A placeholder is a column name and nothing else, so no row value and no template can reach
attribute access, indexing or code. A row whose values cannot fill the template raises RowError:
an error row in the output, the job goes on.
"""

from __future__ import annotations

import decimal
import numbers
from collections.abc import Mapping
from typing import Any

from batchgen.config.suggest import closest
from batchgen.errors import ConfigError


class RowError(Exception):
    """A problem with one row that becomes an error row in the output (finish_reason='error').

    The job goes on. str(e) is the one-line message for the output's `error` column.
    """

    def __init__(self, message: str, *, column: str | None = None):
        super().__init__(message)
        self.column = column


# Characters a placeholder name may not hold: braces end it, and ':' '!' '.' '[' ']' are what
# str.format reads as format spec, conversion, attribute and index. Rejecting them (rather than
# treating them as part of a column name) keeps `{x.__class__}` or `{x:>10}` from ever meaning
# something a reader of the template might expect.
_FORBIDDEN_IN_NAME = set("{}:!.[]\n\r")


class Template:
    """A prompt template with `{column}` placeholders; `{{` and `}}` are literal braces.

    A name is any text between single braces that is non-empty, has no surrounding whitespace and
    holds none of `{ } : ! . [ ]` or a line break; names with spaces or dashes are fine.
    `text=None` means the prompt column's value alone.

    `document_column` is the one column cut when a prompt is too long: the prompt column if the
    template uses it, else the template's last placeholder.
    """

    def __init__(self, text: str | None, prompt_column: str):
        self.text = text
        self.prompt_column = prompt_column
        # Pieces alternate literal text (str) and column names (1-tuples) so render is one pass.
        self._pieces: list[str | tuple[str]] = [(prompt_column,)] if text is None else _parse(text)
        names = [p[0] for p in self._pieces if isinstance(p, tuple)]
        if not names:
            raise ConfigError(f"template {text!r} names no column, so every row would get the same "
                              f"prompt; use e.g. {{{prompt_column}}}")
        self.columns: list[str] = list(dict.fromkeys(names))
        self.document_column: str = prompt_column if prompt_column in names else names[-1]
        self.document_uses = names.count(self.document_column)

    def check_columns(self, available: list[str], source: str) -> None:
        missing = [c for c in self.columns if c not in available]
        if not missing:
            return
        what = (f"column {missing[0]!r}, which does not exist" if len(missing) == 1 else
                f"columns {', '.join(map(repr, missing))}, which do not exist")
        meant = closest(missing[0], available)
        hint = f"; did you mean {{{meant}}}?" if meant is not None else ""
        raise ConfigError(f"{source}: template names {what}; columns: {', '.join(available)}{hint}")

    def render(self, row: Mapping[str, Any], *, document_override: str | None = None) -> str:
        """Fill the placeholders from `row`; `document_override` replaces the document's value."""
        values = {}
        for name in self.columns:
            if name == self.document_column and document_override is not None:
                values[name] = document_override
            else:
                values[name] = self._value(name, row)
        return "".join(p if isinstance(p, str) else values[p[0]] for p in self._pieces)

    def document_value(self, row: Mapping[str, Any]) -> str:
        return self._value(self.document_column, row)

    def _value(self, name: str, row: Mapping[str, Any]) -> str:
        is_doc = name == self.document_column
        label = f"prompt column {name!r}" if name == self.prompt_column else f"column {name!r}"
        if name not in row:  # check_columns runs per file; a JSONL row may still lack a key
            raise RowError(f"{label} is missing from this row", column=name)
        value = row[name]
        if value is None:
            raise RowError(f"{label} is null", column=name)
        if isinstance(value, str):
            text = value
        elif isinstance(value, numbers.Real):  # int, float, bool and numpy scalars read as text
            text = str(value)
        elif isinstance(value, decimal.Decimal):  # a Parquet decimal: its digits as stored, never 1E+3
            text = format(value, "f")
        else:
            raise RowError(f"{label} holds a {type(value).__name__}, not text", column=name)
        if is_doc and text == "":
            raise RowError(f"{label} is empty", column=name)
        if is_doc and text.isspace():
            raise RowError(f"{label} is whitespace only", column=name)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: the tokenizer would fail or mangle them
            raise RowError(f"{label} holds text that is not valid Unicode (at character {e.start})",
                           column=name) from None
        return text


def _parse(text: str) -> list[str | tuple[str]]:
    pieces: list[str | tuple[str]] = []
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "{}" and text.startswith(ch * 2, i):
            literal.append(ch)
            i += 2
        elif ch == "}":
            raise ConfigError(f"template: single '}}' at character {i}; write '}}}}' for a literal brace")
        elif ch == "{":
            end = text.find("}", i + 1)
            inner = text[i + 1:end] if end != -1 else ""
            if end == -1 or "{" in inner:
                raise ConfigError(f"template: '{{' at character {i} is never closed; "
                                  "write '{{' for a literal brace")
            _check_name(inner, i)
            if literal:
                pieces.append("".join(literal))
                literal = []
            pieces.append((inner,))
            i = end + 1
        else:
            literal.append(ch)
            i += 1
    if literal:
        pieces.append("".join(literal))
    return pieces


def _check_name(name: str, pos: int) -> None:
    where = f"template: placeholder {{{name}}} at character {pos}"
    if not name.strip():
        raise ConfigError(f"{where} names no column; placeholders are {{column}}")
    bad = sorted(_FORBIDDEN_IN_NAME & set(name))
    if bad:
        raise ConfigError(f"{where}: {' '.join(map(repr, bad))} not allowed; placeholders are plain "
                          "{column} names, with no attribute, index, conversion or format spec")
    if name != name.strip():
        raise ConfigError(f"{where} has spaces around the name; write {{{name.strip()}}}")
