"""JSON Lines as Arrow: decode records line by line, type them with one schema per file.

batchgen.io.inputs.discovery finds the files and batchgen.io.inputs.readers dispatches on their format; this
module opens a JSONL file through the filesystem it is handed and turns its byte stream into typed
record batches.

Decoding: each line is strict UTF-8 and `json.loads` (never eval); blank lines are skipped and do
not count as rows, so row i is the i-th record. A malformed line, invalid UTF-8 or a non-object
raises InputError with the file, the 0-based row and the 1-based line number; a last line with no
trailing newline that does not decode is skipped with a warning, because a writer killed mid-line
leaves exactly that and failing the whole job over it helps nobody.

Parquet files carry their own schema; JSON Lines does not, and letting pyarrow infer a type per
batch makes batches of one file disagree (int64 in one, string in the next, null where a batch
happens to hold only nulls) and crashes on mixed columns. So a JSONL file gets one schema, from
its first records, and every batch is built against it.

Typing rules (per column, over the non-null values of the sample):
    only bools -> bool; only integers -> int64; integers and floats -> float64 (when every integer
    is exact in a double); only strings -> string; nothing but nulls -> string; anything else
    (a mix of kinds, objects, arrays, integers beyond int64) -> string.
A string column keeps strings as they are and holds every other value as its JSON text
(5 -> "5", true -> "true", {"a": 1} -> '{"a": 1}'): no value is dropped or rounded, only the JSON
type of values in a mixed column is given up. This is the lossless choice; refusing the file
would lose the whole job instead. Objects and arrays are always JSON text because their shape may
differ from record to record, which no single Arrow type can hold; each batch lists those cells
(batchgen.io.inputs.cells.JSON_CELLS_KEY), so that a prompt column holding one is an error row, as a
Parquet list or struct is, not a prompt made of JSON text.

Keys that first appear after the sample are not columns (a column asked for by name must appear in
the sample, so that a misspelt name fails at once): a read of all columns warns once and drops
them. A later value that does not fit a non-string column (a string in an int64 column) cannot be
stored without loss or without changing the type of batches already handed out, so
`records_to_batches` raises InputError with file, row and column.
"""

from __future__ import annotations

import codecs
import itertools
import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.errors import InputError
from batchgen.io.inputs.cells import with_invalid_cells, with_json_cells

logger = logging.getLogger(__name__)

_READ_CHUNK_BYTES = 1 << 20
# Records read to decide a JSONL file's columns and types; they are held in memory meanwhile,
# so this bounds memory as well as how late in a file a new key or a type conflict can hide.
JSONL_SCHEMA_SAMPLE_RECORDS = 1000
_SURROGATE_RE = re.compile("[\ud800-\udfff]")

# Integers up to 2**53 in magnitude are exact in a float64; larger ones would be rounded.
MAX_EXACT_FLOAT_INT = 2**53
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ValueMismatch(ValueError):
    """A value does not fit the column type decided from the sample; `kind` names its JSON kind."""

    def __init__(self, kind: str, arrow_type: pa.DataType):
        super().__init__(f"a JSON {kind} does not fit column type {arrow_type}")
        self.kind = kind


def json_kind(value: Any) -> str:
    """The JSON kind of a parsed value, splitting integers by what Arrow can hold exactly."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is a subclass of int
        return "boolean"
    if isinstance(value, int):
        if abs(value) <= MAX_EXACT_FLOAT_INT:
            return "integer"
        return "large integer" if INT64_MIN <= value <= INT64_MAX else "integer beyond int64"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def infer_type(kinds: set[str]) -> pa.DataType:
    """The column type for the set of non-null JSON kinds seen in the sample (rules above)."""
    if kinds == {"boolean"}:
        return pa.bool_()
    if kinds and kinds <= {"integer", "large integer"}:
        return pa.int64()
    if kinds and kinds <= {"integer", "number"} and "number" in kinds:
        return pa.float64()
    return pa.string()


def infer_schema(records: list[dict[str, Any]]) -> pa.Schema:
    """One schema for the sample: keys in first-seen order, types by `infer_type`."""
    kinds_by_column: dict[str, set[str]] = {}
    for record in records:
        for key, value in record.items():
            kinds = kinds_by_column.setdefault(key, set())
            kind = json_kind(value)
            if kind != "null":
                kinds.add(kind)
    return pa.schema([pa.field(name, infer_type(kinds)) for name, kinds in kinds_by_column.items()])


def coerce_value(value: Any, arrow_type: pa.DataType) -> Any:
    """Return `value` ready for a column of `arrow_type`, or raise ValueMismatch (never rounds)."""
    if value is None:
        return None
    kind = json_kind(value)
    if pa.types.is_string(arrow_type):
        return value if kind == "string" else json.dumps(value, ensure_ascii=False)
    if pa.types.is_boolean(arrow_type) and kind == "boolean":
        return value
    if pa.types.is_int64(arrow_type) and kind in ("integer", "large integer"):
        return value
    if pa.types.is_float64(arrow_type) and kind in ("integer", "number"):
        return value
    raise ValueMismatch(kind, arrow_type)


# ---------------------------------------------------------------- decoding


def _lines(stream: pa.NativeFile) -> Iterator[tuple[bytes, bool]]:
    """Yield (line without its newline, whether a newline ended it), reading bounded chunks."""
    pieces: list[bytes] = []  # the unfinished line; joined once, so long lines cost linear time
    while chunk := stream.read(_READ_CHUNK_BYTES):
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            pieces.append(chunk[start:end])
            yield b"".join(pieces), True
            pieces, start = [], end + 1
        if start < len(chunk):
            pieces.append(chunk[start:])
    if pieces:
        yield b"".join(pieces), False


def read_records(stream: Any, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (row index, record) from a binary stream with `read(n)`; errors name `path`."""
    row = 0
    try:
        for line_no, (raw, terminated) in enumerate(_lines(stream), start=1):
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):  # some Windows editors add one
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                text = raw.decode("utf-8")  # strict: bad bytes are reported, never replaced
                if not text.strip():
                    continue
                record = json.loads(text)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                if not terminated:
                    logger.warning(
                        "%s: skipped the truncated last line %d (%d bytes, no newline at the end)",
                        path, line_no, len(raw),
                    )
                    return
                what = (
                    f"invalid UTF-8 at byte {e.start}"
                    if isinstance(e, UnicodeDecodeError)
                    else f"malformed JSON ({e.msg} at column {e.colno})"
                )
                raise InputError(f"{what} on line {line_no}", path=path, row=row) from e
            if not isinstance(record, dict):
                hint = " (.json files are read as JSON Lines)" if path.endswith(".json") else ""
                what = f"line {line_no} holds a JSON {json_kind(record)}, not an object{hint}"
                raise InputError(what, path=path, row=row)
            yield row, record
            row += 1
    except OSError as e:  # a truncated or corrupt gzip stream, a network read failing
        raise InputError(f"read failed: {e}", path=path, row=row) from e


def records_to_batches(
    records: Iterable[tuple[int, dict[str, Any]]], schema: pa.Schema, batch_size: int, path: str, *,
    num_sample_records: int, warn_new_keys: bool,
) -> Iterator[pa.RecordBatch]:
    """Batches of at most `batch_size` rows with exactly `schema`, values checked by `coerce_value`.

    `num_sample_records` (how many records decided `schema`) only makes the messages precise.
    """
    rows: list[dict[str, Any]] = []
    nested: list[list] = []  # [row in batch, column] of arrays and objects held as JSON text
    known_keys = set(schema.names)
    text_columns = {f.name for f in schema if pa.types.is_string(f.type)}
    for row, record in records:
        if warn_new_keys and not record.keys() <= known_keys:
            logger.warning(
                "%s: row %d has keys %s absent from the first %d records, which decide the columns; "
                "they are not read",
                path, row, sorted(record.keys() - known_keys), num_sample_records,
            )
            warn_new_keys = False  # once per file: the log is for people, not one line per row
        converted = {}
        for field in schema:
            value = record.get(field.name)
            try:
                converted[field.name] = coerce_value(value, field.type)
            except ValueMismatch as e:
                raise InputError(
                    f"{e}, the type its first {num_sample_records} records gave this column",
                    path=path, row=row, column=field.name,
                ) from None
            if isinstance(value, (list, dict)) and field.name in text_columns:
                nested.append([len(rows), field.name])
        rows.append(converted)
        if len(rows) == batch_size:
            yield _batch(rows, schema, nested)
            rows, nested = [], []
    if rows:
        yield _batch(rows, schema, nested)


def _batch(rows: list[dict[str, Any]], schema: pa.Schema, nested: list[list]) -> pa.RecordBatch:
    batch = pa.RecordBatch.from_pylist(rows, schema=schema)
    return with_json_cells(batch, nested) if nested else batch


# ---------------------------------------------------------------- a file


def _records(fs: pafs.FileSystem, fs_path: str, display: str) -> Iterator[tuple[int, dict[str, Any]]]:
    # pyarrow decompresses on the fly; only gzip is a supported input compression (".jsonl.gz").
    compression = "gzip" if display.lower().endswith(".gz") else None
    try:
        stream = fs.open_input_stream(fs_path, compression=compression)
    except FileNotFoundError as e:
        raise InputError("no such file", path=display) from e
    except OSError as e:
        raise InputError(f"cannot open: {e}", path=display) from e
    with stream:
        yield from read_records(stream, display)


def sample_records(fs: pafs.FileSystem, fs_path: str, display: str
                   ) -> tuple[pa.Schema, list[tuple[int, dict]], Iterator]:
    """(schema from the first records, those records, the iterator positioned after them). A file
    without records (0 bytes, blank lines only) has no rows and no columns: an empty schema and sample."""
    records = _records(fs, fs_path, display)
    sample = list(itertools.islice(records, JSONL_SCHEMA_SAMPLE_RECORDS))
    if not sample:
        records.close()  # a closed generator: closing it again, or reading it, is harmless
        return pa.schema([]), [], records
    return infer_schema([record for _, record in sample]), sample, records


def jsonl_batches(sample: list[tuple[int, dict]], records: Iterator, schema: pa.Schema, batch_size: int,
                  display: str, *, warn_new_keys: bool) -> Iterator[pa.RecordBatch]:
    """The sampled records, then the rest, as batches with exactly `schema` (surrogates repaired)."""
    invalid: dict[int, list] = {}
    batches = records_to_batches(
        _scrub_surrogates(itertools.chain(sample, records), schema.names, invalid), schema, batch_size,
        display, num_sample_records=JSONL_SCHEMA_SAMPLE_RECORDS, warn_new_keys=warn_new_keys,
    )
    return _mark_invalid(batches, invalid)


def _scrub_surrogates(records: Iterator[tuple[int, dict]], names: list[str], invalid: dict[int, list]
                      ) -> Iterator[tuple[int, dict]]:
    for row, record in records:
        for name in names:
            value = record.get(name)
            if value is not None and not isinstance(value, (int, float)) and _has_surrogate(value):
                record[name] = _scrub(value)
                invalid.setdefault(row, []).append(
                    [name, f"column {name!r} holds a lone surrogate escape, which is not valid Unicode"])
        yield row, record


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return not value.isascii() and _SURROGATE_RE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE_RE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _mark_invalid(batches: Iterator[pa.RecordBatch], invalid: dict[int, list]) -> Iterator[pa.RecordBatch]:
    first_row = 0
    for batch in batches:
        end = first_row + batch.num_rows
        cells = [[row - first_row, name, message] for row in sorted(r for r in invalid if r < end)
                 for name, message in invalid.pop(row)] if invalid else []
        first_row = end
        if cells:
            batch = with_invalid_cells(batch, cells)
        yield batch
