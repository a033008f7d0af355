"""Per-row sampling overrides (`--sampling-column`): one cell -> the settings that row changes.

A cell is a JSON object (a string) or a struct / map with any of SAMPLING_KEYS; null, or an
empty object, keeps the job's settings. A cell that is not such an object, names another key
or holds a value out of range makes that row an error row, with the reason; the job goes on.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

from batchgen.config.choices import MAX_SAMPLES
from batchgen.config.job import JobConfig, check_penalties
from batchgen.config.rules import TOP_K_OFF, VALUES
from batchgen.config.token_controls import as_params, read_logit_bias, read_token_ids
from batchgen.jobs.prompting.prompts import RowError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "min_tokens", "min_p", "logit_bias", "allowed_token_ids", "n")


def row_sampling(row: dict[str, Any], column: str | None) -> dict[str, Any] | None:
    """The row's overrides, validated; None when the column is unset or the cell is null."""
    if column is None or row.get(column) is None:
        return None
    value = row[column]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"column {column!r} must hold a JSON object of sampling settings: {e}",
                           column=column) from None
    if isinstance(value, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        value = dict(value)  # an Arrow map reads as a list of (key, value) pairs
    if not isinstance(value, dict):
        raise RowError(f"column {column!r} must hold an object of sampling settings, got {type(value).__name__}",
                       column=column)
    overrides = {k: v for k, v in value.items() if v is not None}  # a struct's absent fields read as null
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise RowError(f"column {column!r}: unknown sampling setting {unknown[0]!r} (known: "
                       f"{', '.join(SAMPLING_KEYS)})", column=column)
    _check(overrides, column)
    if overrides.get("top_k") in TOP_K_OFF:
        overrides["top_k"] = None  # vLLM's -1 (or 0): this row samples with no top-k limit
    return overrides or None


def sampling_settings(config: JobConfig, overrides: dict[str, Any] | None, max_new_tokens: int) -> dict[str, Any]:
    """The job's sampling settings with the row's overrides, as SamplingParams keywords.
    min_tokens is capped at the row's max_new_tokens (a per-row budget may be smaller)."""
    settings = {key: getattr(config, key) for key in SAMPLING_KEYS}
    if overrides:
        settings.update(overrides)
    settings["min_tokens"] = min(settings["min_tokens"], max_new_tokens)
    settings.update(as_params(settings["logit_bias"], settings["allowed_token_ids"]))
    return settings


def _check(overrides: dict[str, Any], column: str) -> None:
    def number(key: str, *, integer: bool = False) -> Any:
        value = overrides.get(key)
        kind = numbers.Integral if integer else numbers.Real
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise RowError(f"column {column!r}: {key} must be {'an integer' if integer else 'a number'}, "
                           f"got {value!r}", column=column)
        return value

    for key in ("temperature", "top_p"):  # the job setting's own rule (NaN refused: a float cell or JSON may hold one)
        value, rule = number(key), VALUES[key]
        if value is not None and not rule.ok(value):
            raise RowError(f"column {column!r}: {key} must be {rule.words}, got {value}", column=column)
    top_k = number("top_k", integer=True)
    min_p = number("min_p")
    if min_p is not None and not 0 <= min_p <= 1:
        raise RowError(f"column {column!r}: min_p must be in [0, 1], got {min_p}", column=column)
    if top_k is not None and top_k < 1 and top_k not in TOP_K_OFF:
        raise RowError(f"column {column!r}: top_k must be >= 1, or -1 / 0 for no limit; got {top_k}", column=column)
    for key in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        number(key)
    number("min_tokens", integer=True)
    n = number("n", integer=True)
    if n is not None and not 1 <= n <= MAX_SAMPLES:
        raise RowError(f"column {column!r}: n must be in [1, {MAX_SAMPLES}] (samples of the row), got {n}",
                       column=column)

    def row_error(message: str) -> RowError:
        return RowError(f"column {column!r}: {message}", column=column)

    if "logit_bias" in overrides:  # read here: the ids as integers, whatever the cell's keys were
        overrides["logit_bias"] = read_logit_bias(overrides["logit_bias"], row_error)
    if "allowed_token_ids" in overrides:
        overrides["allowed_token_ids"] = read_token_ids(overrides["allowed_token_ids"], row_error)

    check_penalties(overrides.get("repetition_penalty", 1.0), overrides.get("presence_penalty", 0.0),
                    overrides.get("frequency_penalty", 0.0), overrides.get("min_tokens", 0), row_error)
