"""Cells that did not hold valid text, as a batch lists them for the reader's caller.

Invalid UTF-8 in a Parquet string column, a lone surrogate in JSON: the readers decode such a
cell with U+FFFD replacements, so one bad cell cannot stop a job, and list it in the batch's schema
metadata under INVALID_CELLS_KEY as JSON [[row in batch, column, message], ...]. RowSource
(batchgen.jobs.rows.rows) turns each such row into an error row.

JSON Lines arrays and objects in a string column are held as their JSON text (batchgen.io.inputs.jsonl),
which a prompt must not take for text: the reader lists them under JSON_CELLS_KEY as
[[row in batch, column], ...], and RowSource makes a row whose template column holds one an error
row, as a Parquet list or struct cell is.

A text or bytes cell of more than MAX_CELL_BYTES is listed as invalid too (readers.iter_batches, for
every format): no prompt needs that much text (a prompt is cut to the context long before), and
building one from such a cell holds several copies of it at once. Its row becomes an error row
naming the file, the row and the column.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

INVALID_CELLS_KEY = b"batchgen.invalid_cells"
JSON_CELLS_KEY = b"batchgen.json_cells"
MAX_CELL_BYTES = 64 << 20  # a cell's text (or bytes) beyond this makes its row an error row


def with_invalid_cells(batch: pa.RecordBatch, cells: list[list]) -> pa.RecordBatch:
    """`batch` listing `cells` ([row in batch, column, message] each) in its schema metadata."""
    metadata = {**(batch.schema.metadata or {}), INVALID_CELLS_KEY: json.dumps(cells)}
    return batch.replace_schema_metadata(metadata)


def with_oversized_cells(batch: pa.RecordBatch, path: str, first_row: int) -> pa.RecordBatch:
    """`batch` listing, besides the invalid cells it lists already, each cell of more than
    MAX_CELL_BYTES; `first_row`: the file's row index of the batch's first row, for the message."""
    cells = []
    for field, column in zip(batch.schema, batch.columns, strict=True):
        kind = field.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind)):
            continue
        lengths = pc.binary_length(column)
        if (pc.max(lengths).as_py() or 0) <= MAX_CELL_BYTES:
            continue
        for row in pc.indices_nonzero(pc.greater(lengths, MAX_CELL_BYTES)).to_pylist():
            cells.append([row, field.name, f"column {field.name!r} holds {lengths[row].as_py()} bytes, over the "
                                           f"{MAX_CELL_BYTES} bytes a cell may hold ({path}, row {first_row + row})"])
    if not cells:
        return batch
    listed = (batch.schema.metadata or {}).get(INVALID_CELLS_KEY)
    return with_invalid_cells(batch, (json.loads(listed) if listed is not None else []) + cells)


def invalid_cells(batch: pa.RecordBatch) -> dict[int, str]:
    """{row in batch: message} for the cells a reader had to repair."""
    raw = (batch.schema.metadata or {}).get(INVALID_CELLS_KEY)
    if raw is None:
        return {}
    out: dict[int, str] = {}
    for row, _column, message in json.loads(raw):
        out[row] = f"{out[row]}; {message}" if row in out else message
    return out


def with_json_cells(batch: pa.RecordBatch, cells: list[list]) -> pa.RecordBatch:
    """`batch` listing `cells` ([row in batch, column] each: a JSON array or object held as its text)."""
    metadata = {**(batch.schema.metadata or {}), JSON_CELLS_KEY: json.dumps(cells)}
    return batch.replace_schema_metadata(metadata)


def json_cells(batch: pa.RecordBatch) -> dict[int, list[str]]:
    """{row in batch: [column, ...]} of the cells that hold a JSON array or object as text."""
    raw = (batch.schema.metadata or {}).get(JSON_CELLS_KEY)
    out: dict[int, list[str]] = {}
    for row, column in json.loads(raw) if raw is not None else []:
        out.setdefault(row, []).append(column)
    return out
