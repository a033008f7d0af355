"""The input scan: one pass over the id column before any output is touched.

Row counts per file (for status, progress and _SUCCESS) and duplicate or null ids, reported with
file, row and column; each file's identity (batchgen.jobs.durability.identity) for the manifest. Parquet
files with derived ids need no read at all. A JSON Lines file is read whole anyway (its rows are
not counted anywhere else), so every column the job reads is typed in the same pass: a value late
in the file that does not fit its column's type is refused here, before the first commit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.errors import InputError
from batchgen.io.inputs.readers import iter_batches
from batchgen.jobs.durability.identity import file_identity
from batchgen.jobs.rows.rows import RowSource


@dataclass(slots=True)
class InputScan:
    file_rows: list[tuple[str, int]]  # (file path, rows this run reads from it), input order
    identities: list[dict[str, Any]] | None = None  # per file, batchgen.jobs.durability.identity.file_identity
    ids: set[Any] | None = None  # the input's ids (--id-column), until the run has compared them
    # a shard of a sharded job: {"num_shards", "shard_index", "job_inputs": digest of every file's identity}
    split: dict[str, Any] | None = None

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.file_rows)

    def to_json(self) -> list[dict[str, Any]]:
        identities = self.identities or [None] * len(self.file_rows)
        return [{"path": path, "num_rows": n, **({"identity": identity} if identity else {})}
                for (path, n), identity in zip(self.file_rows, identities, strict=True)]


def scan_inputs(source: RowSource) -> InputScan:
    """Count rows per file and check ids, reading only the id column; --max-rows applies.

    Parquet files with derived ids need no read at all (the footer has the count, and
    "<file>:<row>" ids are unique by construction).
    """
    config = source.config
    id_column = config.id_column
    if id_column:
        id_type = source.id_field.type
        if not (pa.types.is_integer(id_type) or pa.types.is_string(id_type) or pa.types.is_large_string(id_type)):
            raise InputError(f"--id-column {id_column!r} holds {id_type}; ids must be integers or strings",
                             column=id_column)
    remaining = source.max_rows  # None in a sharded job's share: the split applied it
    seen: set[Any] = set()
    file_rows = []
    for file in source.files:
        if remaining is not None and remaining <= 0:
            file_rows.append((file.path, 0))
            continue
        if file.num_rows is not None and not id_column:
            n = file.num_rows_read if remaining is None else min(file.num_rows_read, remaining)
        else:
            column = id_column or source.read_columns[0]
            columns = [column]
            if file.format == "jsonl":  # the whole line is parsed anyway: type every column read
                present = set(source.file_schemas[len(file_rows)].names)
                columns = list(dict.fromkeys([column, *(c for c in source.read_columns if c in present)]))
            n = 0
            for batch in iter_batches(file, columns, config.read_batch_size):
                values = batch.column(0).to_pylist() if id_column else [None] * batch.num_rows
                if remaining is not None:
                    values = values[: remaining - n]
                if id_column:
                    for i, row_id in enumerate(values):
                        _check_id(source, seen, row_id, file.path, file.first_row + n + i)
                n += len(values)
                if remaining is not None and n >= remaining:
                    break
        file_rows.append((file.path, n))
        if remaining is not None:
            remaining -= n
    identities = [file_identity(file, schema) for file, schema in zip(source.files, source.file_schemas, strict=True)]
    return InputScan(file_rows, identities, seen if id_column else None, _split(source))


def _split(source: RowSource) -> dict[str, Any] | None:
    """What `batchgen finalize` compares across a sharded job's shards: the split, and a digest of
    every file's identity, so that shards which read other inputs (a file added between two shards'
    runs moves the split) are not taken for one job."""
    config = source.config
    if source.job_files is None:
        return None
    files = [[file.path, file_identity(file, schema)] for file, schema in source.job_files]
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    return {"num_shards": config.num_shards, "shard_index": config.shard_index, "job_inputs": digest}


def _check_id(source: RowSource, seen: set[Any], row_id: Any, path: str, row: int) -> None:
    column = source.config.id_column
    if row_id is None:
        raise InputError("id is null; every row needs an id", path=path, row=row, column=column)
    if row_id in seen:
        first = _first_occurrence(source, row_id)
        raise InputError(f"duplicate id {row_id!r} (first at {first}); ids must be unique, because "
                         "the output is keyed by them", path=path, row=row, column=column)
    seen.add(row_id)


def _first_occurrence(source: RowSource, row_id: Any) -> str:
    for file in source.files:  # only on the error path: a second read is cheaper than a map
        n = 0
        for batch in iter_batches(file, [source.config.id_column], source.config.read_batch_size):
            values = batch.column(0).to_pylist()
            if row_id in values:
                return f"{file.path}, row {n + values.index(row_id)}"
            n += len(values)
    return "?"
