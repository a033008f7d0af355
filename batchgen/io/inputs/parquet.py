"""Reading Parquet input: open a file through its filesystem, stream its row groups as batches.

A bad footer or a corrupt page is an InputError naming the file (and the row reached). Parquet
does not check that string cells are UTF-8: a cell that is not is read with U+FFFD replacements
and listed as invalid (batchgen.io.inputs.cells), so one bad cell becomes one error row, not a crash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchgen.errors import InputError
from batchgen.io.inputs.cells import with_invalid_cells


@contextlib.contextmanager
def open_parquet(fs: pafs.FileSystem, fs_path: str, display: str) -> Iterator[pq.ParquetFile]:
    """Open a Parquet file through its filesystem; a bad footer is an InputError naming it."""
    try:
        file = fs.open_input_file(fs_path)
    except FileNotFoundError as e:
        raise InputError("no such file", path=display) from e
    except OSError as e:
        raise InputError(f"cannot open: {e}", path=display) from e
    with file:  # ParquetFile does not close a file it was handed
        try:
            parquet_file = pq.ParquetFile(file)
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"not a valid Parquet file: {e}", path=display) from e
        yield parquet_file


def parquet_batches(fs: pafs.FileSystem, fs_path: str, display: str, columns: list[str] | None,
                    batch_size: int, *, rows: tuple[int, int] | None = None) -> Iterator[pa.RecordBatch]:
    """The file's rows in order, as batches of at most batch_size rows (empty row groups skipped).

    `rows` = [start, stop): only those rows. Only the row groups that hold them are read (their
    row counts are in the footer); rows of the first and last of those outside the range are
    dropped after decoding, so a share of a file costs at most two row groups' extra reading."""
    with open_parquet(fs, fs_path, display) as parquet_file:
        start, stop = rows if rows is not None else (0, parquet_file.metadata.num_rows)
        groups, position = _row_groups(parquet_file.metadata, start, stop)  # position: the first group's first row
        if not groups:
            return
        batches = parquet_file.iter_batches(batch_size=batch_size, columns=columns, row_groups=groups)
        while position < stop:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError) as e:  # a corrupt page or column chunk
                raise InputError(f"cannot read Parquet data: {e}", path=display, row=position) from e
            first, position = position, position + batch.num_rows
            if position <= start:  # a batch of the first row group before the range
                continue
            batch = batch.slice(max(start - first, 0), min(stop, position) - max(start, first))
            if batch.num_rows:  # a row group may be empty; callers count rows, not batches
                yield _repair_utf8(batch)


def _row_groups(metadata: pq.FileMetaData, start: int, stop: int) -> tuple[list[int], int]:
    """The row groups holding rows [start, stop), and the file row index of the first one's first row."""
    groups, first, position = [], 0, 0
    for i in range(metadata.num_row_groups):
        n = metadata.row_group(i).num_rows
        if position + n > start and position < stop:
            if not groups:
                first = position
            groups.append(i)
        position += n
    return groups, first


def _repair_utf8(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Parquet does not check that string cells are UTF-8; to_pylist would crash on one that is not.

    Such a cell is decoded with U+FFFD replacements and listed under INVALID_CELLS_KEY.
    """
    invalid = []
    columns = list(batch.columns)
    for i, field in enumerate(batch.schema):
        if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
            continue
        try:
            columns[i].validate(full=True)  # a vectorised UTF-8 check; the slow path below is rare
            continue
        except pa.ArrowInvalid:
            pass
        raw_type = pa.binary() if pa.types.is_string(field.type) else pa.large_binary()
        values = []
        for row, raw in enumerate(columns[i].view(raw_type).to_pylist()):
            try:
                values.append(None if raw is None else raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                values.append(raw.decode("utf-8", "replace"))
                invalid.append([row, field.name, f"column {field.name!r} is not valid UTF-8 (byte "
                                                 f"{raw[e.start]:#04x} at offset {e.start})"])
        columns[i] = pa.array(values, field.type)
    if not invalid:
        return batch
    return with_invalid_cells(pa.RecordBatch.from_arrays(columns, schema=batch.schema), invalid)
