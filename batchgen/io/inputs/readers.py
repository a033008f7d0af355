"""Reading one input file, whatever its format: its schema, its columns, its rows as bounded batches.

The files come from batchgen.io.inputs.discovery; Parquet and JSON Lines each have their module
(batchgen.io.inputs.parquet, batchgen.io.inputs.jsonl). Problems a user can fix raise InputError naming the
file, and where known the row and column.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from batchgen.errors import InputError
from batchgen.io.inputs.cells import with_oversized_cells
from batchgen.io.inputs.discovery import InputFile, filesystem
from batchgen.io.inputs.jsonl import jsonl_batches, sample_records
from batchgen.io.inputs.openai_batch import OPENAI_BATCH_SCHEMA, check_first_request, openai_batch_batches
from batchgen.io.inputs.parquet import open_parquet, parquet_batches


def read_schema(file: InputFile) -> pa.Schema:
    """The file's Arrow schema: the Parquet schema, or the one JSONL batches will carry. An empty
    file (0 bytes; JSON Lines without a record) has no rows and an empty schema (`holds_no_rows`)."""
    if file.size == 0:
        return pa.schema([])
    if file.format == "parquet":
        with open_parquet(*filesystem(file.path), file.path) as parquet_file:
            return parquet_file.schema_arrow
    if file.format == "openai-batch":  # a fixed schema; the first request is read to check the file
        check_first_request(*filesystem(file.path), file.path)
        return OPENAI_BATCH_SCHEMA
    schema, _, records = sample_records(*filesystem(file.path), file.path)
    records.close()
    return schema


def holds_no_rows(file: InputFile) -> bool:
    """An empty file: 0 bytes, a Parquet footer of 0 rows, JSON Lines without a record. An empty
    partition of a scheduled job looks like this; its columns cannot (JSON Lines) or need not be checked."""
    if file.size == 0 or file.num_rows == 0:
        return True
    if file.format == "parquet":
        return False
    _, sample, records = sample_records(*filesystem(file.path), file.path)
    records.close()
    return not sample


def read_columns(file: InputFile) -> list[str]:
    """Column names: Parquet's schema, or for JSONL the keys of its first records, first seen first."""
    return read_schema(file).names


def iter_batches(file: InputFile, columns: list[str] | None, batch_size: int) -> Iterator[pa.RecordBatch]:
    """Stream the file in its order as record batches of at most `batch_size` rows.

    Only `columns` are read (None = all), in the order given. The i-th row over all batches is
    row i of the file (0-based); for JSONL that is the i-th non-blank line. A Parquet file with a
    row range (a sharded job's share of a file) yields only those rows: row i is the file's row
    `file.first_row + i`. Missing columns are
    checked before the first batch, so this raises at once rather than on first iteration.

    JSON Lines policy (details in batchgen.io.inputs.jsonl):
      - each line is decoded as strict UTF-8 and parsed with `json.loads`; blank lines are skipped;
      - a malformed line, invalid UTF-8 or a record that is not an object raises InputError naming
        the file, the row and the 1-based line number;
      - except a last line with no trailing newline that does not parse: a writer killed mid-line
        leaves exactly that, so it is skipped with a logged warning rather than failing the job;
      - columns and types come from the first JSONL_SCHEMA_SAMPLE_RECORDS records; keys absent
        from a record read as null; a column whose JSON kinds conflict becomes a string column
        holding JSON text (nothing is dropped or rounded); a later value that cannot fit its
        column's type raises InputError with file, row and column;
      - a lone surrogate (a "\\ud800" escape with no partner) is not Unicode text and cannot be
        stored as UTF-8: it is replaced by U+FFFD and the cell listed as invalid (below).

    Cells that did not hold valid text (invalid UTF-8 in a Parquet string column, a lone
    surrogate in JSON) are read with U+FFFD replacements, so one bad cell cannot stop a job; the
    batch lists them (batchgen.io.inputs.cells), and RowSource turns each such row into an error row.
    So are cells of more than MAX_CELL_BYTES, in every format.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if file.size == 0:  # an empty file: no rows (a 0-byte Parquet file has no footer to read)
        return iter(())
    if file.format == "parquet":
        _check_columns(file, columns, read_columns(file))
        return _capped(parquet_batches(*filesystem(file.path), file.path, columns, batch_size, rows=file.rows),
                       file)
    assert file.rows is None, "JSON Lines files (Batch request ones too) are split whole (row count unknown unread)"
    if file.format == "openai-batch":
        _check_columns(file, columns, OPENAI_BATCH_SCHEMA.names)
        return _capped(openai_batch_batches(*filesystem(file.path), file.path, columns, batch_size), file)
    schema, sample, records = sample_records(*filesystem(file.path), file.path)
    if not sample:  # no records: no rows, whichever columns were asked for
        return iter(())
    try:
        _check_columns(file, columns, schema.names)
    except InputError:
        records.close()
        raise
    if columns is not None:
        schema = pa.schema([schema.field(name) for name in columns])
    return _capped(jsonl_batches(sample, records, schema, batch_size, file.path, warn_new_keys=columns is None),
                   file)


def _capped(batches: Iterator[pa.RecordBatch], file: InputFile) -> Iterator[pa.RecordBatch]:
    """The batches, each listing its cells of more than MAX_CELL_BYTES (batchgen.io.inputs.cells)."""
    first_row = file.first_row
    for batch in batches:
        yield with_oversized_cells(batch, file.path, first_row)
        first_row += batch.num_rows


def _check_columns(file: InputFile, columns: list[str] | None, existing: list[str]) -> None:
    if columns is None:
        return
    assert len(set(columns)) == len(columns), f"duplicate columns requested: {columns}"
    for name in columns:
        if name not in existing:
            listed = ", ".join(repr(c) for c in existing[:50]) + (", ..." if len(existing) > 50 else "")
            raise InputError(f"no such column; the file has: {listed}", path=file.path, column=name)
