"""Cells that did not hold valid text, as a batch lists them for the reader's caller.

Invalid UTF-8 in a Parquet string column, a lone surrogate in JSON: the readers decode such a
cell with U+FFFD replacements, so one bad cell cannot stop a job, and list it in the batch's schema
metadata under INVALID_CELLS_KEY as JSON [[row in batch, column, message], ...]. RowSource
(batchgen.jobs.pipeline.rows) turns each such row into an error row.

JSON Lines arrays and objects in a string column are held as their JSON text (batchgen.io.inputs.jsonl),
which a prompt must not take for text: the reader lists them under JSON_CELLS_KEY as
[[row in batch, column], ...], and RowSource makes a row whose template column holds one an error
row, as a Parquet list or struct cell is.
"""

from __future__ import annotations

import json

import pyarrow as pa

INVALID_CELLS_KEY = b"batchgen.invalid_cells"
JSON_CELLS_KEY = b"batchgen.json_cells"


def with_invalid_cells(batch: pa.RecordBatch, cells: list[list]) -> pa.RecordBatch:
    """`batch` listing `cells` ([row in batch, column, message] each) in its schema metadata."""
    metadata = {**(batch.schema.metadata or {}), INVALID_CELLS_KEY: json.dumps(cells)}
    return batch.replace_schema_metadata(metadata)


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
