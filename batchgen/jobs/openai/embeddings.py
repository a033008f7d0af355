"""One `POST /v1/embeddings` request (a row of batchgen.io.inputs.openai_batch) -> a planned row of an
embed job, or a coded error row.

The body, as the API takes it:

    input            a string, an array of strings, an array of token ids, or an array of such arrays
                     (at most MAX_INPUTS); several inputs are like a chat request's n choices: one
                     output row each, keyed by sample_index, answered together in one response line
    dimensions       >= 1: the line's embeddings cut to their first N values (Matryoshka), in output.jsonl
    encoding_format  float (the default) or base64 (the little-endian float32 bytes), in output.jsonl
    model, user      recorded or ignored: the job runs its --model for every line

A text input is tokenized as a plain row of an embed job is (with the model's special tokens, as
sentence-transformers does); token ids are taken as given. As the API does, an input longer than
the model reads is an error (context_length_exceeded), never cut, whatever --on-long-prompt says.

The Parquet output keeps every embedding at the job's size (its column is fixed-size), so
`dimensions` and `encoding_format` shape only the response line (batchgen.jobs.openai.embedding_output,
which reads them from the request's body, a kept column in these jobs). Both enter the row's settings,
so a resume under the same custom_id answers an edited line again.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

from batchgen.config.job import JobConfig
from batchgen.io.inputs.openai_batch import EMBEDDINGS_URL
from batchgen.jobs.openai.body_fields import check_text, number, request_body
from batchgen.jobs.prompting.prompts import PromptBuilder
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.request_error import RequestError
from batchgen.jobs.rows.rows import InputRow

MAX_INPUTS = 2048  # the API's limit on one request's inputs
ENCODING_FORMATS = ("float", "base64")
FIELDS = frozenset({"input", "model", "dimensions", "encoding_format", "user"})


@dataclass(slots=True)
class EmbeddingsRequest:
    inputs: list[str | list[int]]  # each input: text, or token ids
    dimensions: int | None = None  # None: the job's embedding, whole
    encoding_format: str = "float"


def parse_embeddings(values: dict[str, Any]) -> EmbeddingsRequest:
    """Check one request row (method, url, body) of an embed job; RequestError if the API would refuse it."""
    method, url = values.get("method"), values.get("url")
    if method != "POST":
        raise RequestError("unsupported_method", f"method must be POST, got {method!r}", param="method")
    if url != EMBEDDINGS_URL:
        raise RequestError("unsupported_url", f"url {url!r} is not supported in a job of {EMBEDDINGS_URL} "
                           f"requests", param="url")
    body = request_body(values.get("body"))
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        raise RequestError("unsupported_parameter", f"body field {unknown[0]!r} is not supported for "
                           f"{EMBEDDINGS_URL}", param=unknown[0])
    body = {k: v for k, v in body.items() if v is not None}  # null means the default, as in the API
    request = EmbeddingsRequest(_inputs(body.get("input")))
    if "dimensions" in body:
        request.dimensions = number(body, "dimensions", integer=True, low=1)
    if "encoding_format" in body:
        if body["encoding_format"] not in ENCODING_FORMATS:
            raise RequestError("invalid_value", f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                               f"got {json.dumps(body['encoding_format'])[:40]}", param="encoding_format")
        request.encoding_format = body["encoding_format"]
    return request


def prepare_embeddings_row(row: InputRow, builder: PromptBuilder, config: JobConfig) -> PlannedRow:
    """An embeddings request row -> each input's token ids (one output row each); RequestError for an error row."""
    request = parse_embeddings(row.values)
    parse = config.parse_special_tokens if config.parse_special_tokens is not None else True
    vocab_size = len(builder.tokenizer)
    inputs: list[list[int]] = []
    for i, item in enumerate(request.inputs):
        where = "input" if len(request.inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            ids = builder.text_token_ids(item, parse_special_tokens=parse)
        else:
            bad = next((t for t in item if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise RequestError("invalid_value", f"{where} holds token id {bad}, outside the model's vocabulary "
                                   f"of {vocab_size}", param=where)
            ids = list(item)
        room = builder.max_context_tokens
        if builder.max_prompt_tokens is not None:
            room = min(room, builder.max_prompt_tokens)
        if len(ids) > room:
            raise RequestError("context_length_exceeded", f"{where} has {len(ids)} tokens; the model reads at "
                               f"most {room}", param=where)
        inputs.append(ids)
    settings: dict[str, Any] = {"dimensions": request.dimensions, "encoding_format": request.encoding_format}
    if len(inputs) > 1:  # the hash covers the concatenated ids: where each input ends is part of the request
        settings["input_tokens"] = [len(ids) for ids in inputs]
    return PlannedRow(row, [t for ids in inputs for t in ids], 0,
                      encode_inputs=inputs if len(inputs) > 1 else None, num_samples=len(inputs),
                      settings_key=json.dumps(settings, sort_keys=True))


def _inputs(value: Any) -> list[str | list[int]]:
    """The body's `input` as a list of inputs, each text or token ids."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        items = [value]  # one input given as token ids
    elif isinstance(value, list) and value:
        items = value
    else:
        raise RequestError("invalid_value" if isinstance(value, list) else "invalid_request",
                           "input must be a non-empty string or array (of strings, or of token id arrays)",
                           param="input")
    if len(items) > MAX_INPUTS:
        raise RequestError("invalid_value", f"input holds {len(items)} inputs; at most {MAX_INPUTS} per request",
                           param="input")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]" if items is value else "input"  # an array of inputs, or the one input
        if isinstance(item, str) != isinstance(items[0], str):  # the API takes strings or token arrays, not both
            raise RequestError("invalid_value", f"{where}: input mixes strings and token id arrays", param=where)
        if isinstance(item, str):
            if not item:
                raise RequestError("invalid_value", f"{where} is an empty string", param=where)
            check_text(item, where)
            out.append(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            out.append([int(t) for t in item])
        else:
            raise RequestError("invalid_value", f"{where} must be a non-empty string or a non-empty array of token "
                               f"ids, got {json.dumps(item)[:40]}", param=where)
    return out


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
