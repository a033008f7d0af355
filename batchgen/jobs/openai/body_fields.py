"""Reading a Batch API request's body and its fields, shared by every endpoint's parser: a field's
problem is a RequestError carrying the API's error code and the field's name."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from batchgen.jobs.rows.request_error import RequestError


def request_body(text: Any) -> dict[str, Any]:
    if text is None:
        raise RequestError("invalid_request", "the request has no body", param="body")
    body = json.loads(text)  # written by the reader as JSON text of what the line held
    if not isinstance(body, dict):
        raise RequestError("invalid_request", f"body must be an object, got a JSON {type(body).__name__}",
                           param="body")
    return body


def check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escape: the tokenizer would fail or mangle it
        raise RequestError("invalid_prompt", f"{where} holds text that is not valid Unicode (at character {e.start})",
                           param=where) from None


def number(body: dict[str, Any], name: str, *, integer: bool = False, low: float | None = None,
            high: float | None = None) -> Any:
    value = body[name]
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        if integer and isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise RequestError("invalid_value", f"{name} must be {'an integer' if integer else 'a number'}, "
                               f"got {json.dumps(value)[:40]}", param=name)
    if not math.isfinite(value):
        raise RequestError("invalid_value", f"{name} must be a finite number, got {value}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise RequestError("invalid_value", f"{name} must be in {bounds}, got {value}", param=name)
    return value
