"""Backslash escapes in command-line text, read as vLLM and OpenAI API users write them.

A shell passes `--stop "\\n"` as the two characters backslash and n; in a Python or JSON
`stop=["\\n"]` the same spelling is a newline, and that is what a user pasting a vLLM call means.
So flag values that are text to match or to render (--stop, --template) get the escapes of a
JSON / Python string: \\n \\t \\r \\\\ \\" \\' \\0 \\xHH \\uHHHH \\UHHHHHHHH. A backslash before any
other character stays as typed (a regex-like "\\d" in a template is not an error).

YAML config files are not decoded again: YAML's double-quoted strings have these escapes already
("\\n" is a newline there) and its single-quoted ones mean the text literally.
"""

from __future__ import annotations

import re

from batchgen.errors import ConfigError

_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0", "a": "\a", "b": "\b",
           "f": "\f", "v": "\v"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[xuU]|.)", re.DOTALL)
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def unescape(text: str, flag: str) -> str:
    """`text` with its backslash escapes decoded; ConfigError naming `flag` for a cut-short \\x, \\u, \\U."""

    def decode(match: re.Match) -> str:
        body = match.group(1)
        if body in _HEX_DIGITS:
            raise ConfigError(f"{flag}: \\{body} needs {_HEX_DIGITS[body]} hex digits, in {text!r}")
        if body[0] in _HEX_DIGITS:
            code = int(body[1:], 16)
            if code > 0x10FFFF:
                raise ConfigError(f"{flag}: \\{body} is not a Unicode code point, in {text!r}")
            return chr(code)
        return _SIMPLE.get(body, match.group(0))

    out = _ESCAPE.sub(decode, text)
    try:  # "\\ud83d\\ude00", as JSON writes one emoji: a surrogate pair becomes its one character
        return out.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        raise ConfigError(f"{flag}: a lone UTF-16 surrogate escape in {text!r}") from None
