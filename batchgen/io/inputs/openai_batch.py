"""OpenAI Batch API request files as Arrow: one fixed schema, one row per request line.

A request line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
Lines are decoded as any JSON Lines file is (batchgen.io.inputs.jsonl.read_records: strict UTF-8, a
malformed line raises InputError naming the file, the row and the line, a truncated last line is
skipped with a warning), then laid out in OPENAI_BATCH_SCHEMA, whatever the sample of the file
holds, so every file of a job has the same columns and types:

    custom_id  the row id; missing, null, empty or not a string is an InputError (exit 2): the API
               refuses such a file at upload, and the output is keyed by it
    method, url, model (the body's "model", recorded, never used to pick a model)
    body       the body as JSON text, parsed per row by batchgen.jobs.openai.requests

A file holds either embeddings requests (/v1/embeddings) or generation requests (/v1/chat/completions,
/v1/completions): the first request of the other kind is an InputError naming its row and url, as
the two need different models and output shapes (KindCheck).

What the API would answer with an error for one request is not an InputError: such lines are
still rows, and become error rows in the API's shape. An unknown field in the request line, or a
lone surrogate escape in method or url, is listed here as an invalid cell (batchgen.io.inputs.cells),
which makes the row an error row; the body's problems (not an object, unsupported fields, an
unsupported url) are found by the request parser. The body keeps a lone surrogate escaped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.errors import InputError
from batchgen.io.inputs.cells import with_invalid_cells
from batchgen.io.inputs.jsonl import _records  # the JSON Lines decoder, with its errors

ID_COLUMN = "custom_id"
CHAT_URL = "/v1/chat/completions"  # the endpoints batchgen answers (batchgen.jobs.openai.requests)
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
# a job either generates (chat and text completions) or embeds: one file, or one job's files, never mixes them
EMBEDDINGS, GENERATION = "embeddings", "generation"
_KIND_OF_URL = {CHAT_URL: GENERATION, COMPLETIONS_URL: GENERATION, EMBEDDINGS_URL: EMBEDDINGS}
REQUEST_FIELDS = ("custom_id", "method", "url", "body")  # a request line's fields, as the API defines them
OPENAI_BATCH_SCHEMA = pa.schema([
    pa.field(ID_COLUMN, pa.string()),
    pa.field("method", pa.string()),
    pa.field("url", pa.string()),
    pa.field("model", pa.string()),
    pa.field("body", pa.string()),
])
# Error rows of Batch API requests keep the API's error code (and the parameter at fault, where one
# is) in their message, "<code>: <text>" or "<code> [<param>]: <text>" (the `error` column of the
# Parquet output); the output files split it back (split_api_error).
API_ERROR_CODES = ("invalid_request", "unsupported_url", "unsupported_method", "unsupported_parameter",
                   "invalid_value", "context_length_exceeded", "invalid_prompt")
_CODED_RE = re.compile(r"(?P<code>[a-z_]+)(?: \[(?P<param>[^\n]+?)\])?: (?P<message>.*)", re.DOTALL)


def api_error(code: str, message: str, param: str | None = None) -> str:
    assert code in API_ERROR_CODES, code
    return f"{code}: {message}" if param is None else f"{code} [{param}]: {message}"


def split_api_error(text: str) -> tuple[str, str | None, str]:
    """(code, param, message) of an error row's message; a message without a code (an error of the
    prompt as any job reports it) gets the code that fits it."""
    match = _CODED_RE.fullmatch(text)
    if match and match["code"] in API_ERROR_CODES:
        return match["code"], match["param"], match["message"]
    if "context" in text and ("prompt has" in text or "leaves no room" in text):
        return "context_length_exceeded", None, text
    return "invalid_prompt", None, text


def request_row(record: dict[str, Any], path: str, row: int) -> tuple[dict[str, Any], list[str]]:
    """One request line -> (the row in OPENAI_BATCH_SCHEMA, messages about cells that are not text)."""
    custom_id = record.get(ID_COLUMN)
    if not isinstance(custom_id, str) or not custom_id:
        got = "it is missing" if ID_COLUMN not in record else f"got {json.dumps(custom_id)[:40]}"
        raise InputError(f"every request needs a non-empty string custom_id ({got})", path=path, row=row,
                         column=ID_COLUMN)
    if not _is_text(custom_id):
        raise InputError("custom_id holds a lone surrogate escape, which is not valid Unicode", path=path, row=row,
                         column=ID_COLUMN)
    invalid = []
    out: dict[str, Any] = {ID_COLUMN: custom_id}
    for name in ("method", "url"):
        value = record.get(name)
        out[name] = value if value is None or isinstance(value, str) else json.dumps(value)
        if isinstance(out[name], str) and not _is_text(out[name]):
            out[name] = out[name].encode("utf-8", "replace").decode("utf-8")
            invalid.append(api_error("invalid_request", f"field {name!r} holds a lone surrogate escape, "
                                     "which is not valid Unicode"))
    body = record.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    out["model"] = model if model is None or isinstance(model, str) else json.dumps(model)
    if isinstance(out["model"], str) and not _is_text(out["model"]):
        out["model"] = out["model"].encode("utf-8", "replace").decode("utf-8")  # recorded only, never used
    out["body"] = None if "body" not in record else _json_text(body)
    extra = sorted(k for k in record if k not in REQUEST_FIELDS)
    if extra:
        invalid.append(api_error("invalid_request", f"unknown field {extra[0]!r} in the request line "
                                 f"(a request has {', '.join(REQUEST_FIELDS)})", extra[0]))
    return out, invalid


def request_kind(url: Any) -> str | None:
    """EMBEDDINGS or GENERATION for a url batchgen answers; None for any other (an error row of its own)."""
    return _KIND_OF_URL.get(url) if isinstance(url, str) else None


class KindCheck:
    """Refuses (InputError, exit 2) a file's first request whose kind differs from the file's first
    one: an embeddings request and a generation request need different models and output shapes, so
    one job cannot answer both. Rows of a url batchgen does not answer are left to their own error rows."""

    def __init__(self) -> None:
        self.first: tuple[str, int, str] | None = None  # (kind, row, url)

    def see(self, url: Any, path: str, row: int, custom_id: str) -> None:
        kind = request_kind(url)
        if kind is None:
            return
        if self.first is None:
            self.first = (kind, row, url)
            return
        first_kind, first_row, first_url = self.first
        if kind != first_kind:
            raise InputError(f"request {custom_id!r} is a {url} request, but the file's first request (row "
                             f"{first_row}) is a {first_url} one: embeddings and completions cannot share a "
                             "job; put them in separate files and run each as its own job",
                             path=path, row=row, column="url")


def openai_batch_batches(fs: pafs.FileSystem, fs_path: str, display: str, columns: list[str] | None,
                         batch_size: int) -> Iterator[pa.RecordBatch]:
    """The file's requests as batches of OPENAI_BATCH_SCHEMA (only `columns`, if given). A file that
    mixes embeddings and generation requests raises InputError at the first request of the other kind."""
    schema = OPENAI_BATCH_SCHEMA if columns is None else pa.schema([OPENAI_BATCH_SCHEMA.field(c) for c in columns])
    rows: list[dict[str, Any]] = []
    cells: list[list] = []
    kinds = KindCheck()
    for row, record in _records(fs, fs_path, display):
        values, invalid = request_row(record, display, row)
        kinds.see(values["url"], display, row, values[ID_COLUMN])
        cells.extend([len(rows), "request", message] for message in invalid)
        rows.append(values)
        if len(rows) == batch_size:
            yield _batch(rows, schema, cells)
            rows, cells = [], []
    if rows:
        yield _batch(rows, schema, cells)


def check_first_request(fs: pafs.FileSystem, fs_path: str, display: str) -> tuple[int, str | None] | None:
    """Read the first request (a malformed first line fails here, naming the file): (its row, its url);
    None for a file without requests, which holds no rows, as an empty JSON Lines file does."""
    records = _records(fs, fs_path, display)
    try:
        first = next(records, None)
    finally:
        records.close()
    if first is None:
        return None
    values, _ = request_row(first[1], display, first[0])
    return first[0], values["url"]


def _batch(rows: list[dict[str, Any]], schema: pa.Schema, cells: list[list]) -> pa.RecordBatch:
    batch = pa.RecordBatch.from_pylist([{name: r[name] for name in schema.names} for r in rows], schema=schema)
    return with_invalid_cells(batch, cells) if cells else batch


def _json_text(value: Any) -> str:
    """JSON text of a parsed value; ASCII escapes only where it holds a lone surrogate (which UTF-8,
    and so Arrow, cannot store), so the text round-trips to the value either way."""
    text = json.dumps(value, ensure_ascii=False)
    return text if _is_text(text) else json.dumps(value)


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
