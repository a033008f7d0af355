"""The two stages of the Ray Data pipeline: reading input files, and generating in an actor pool.

Reading is a map over the input files (one item per file), not ray.data.read_parquet: batchgen's
own readers give the rows the ids, types and error rows `batchgen run` gives them (derived ids
"<file>:<row index>" need each row's index in its file, JSON Lines are typed and checked as the local
executor reads them, a cell that is not valid text becomes an error row), and any pyarrow
filesystem the local executor reads, the workers read. Rows an earlier run settled are dropped
here, before they reach an actor (ResumeRule.skips, decided on the driver and shipped as one set).

Generating is BatchGenerator (batchgen.jobs.pipeline.batch_fn) held by an actor: one model per actor, loaded
once. Each output table carries the actor's model fingerprint in one more column, so the driver can
begin the job with the full fingerprint and refuse actors that disagree (another dtype on another node).

Nothing here imports ray: these run inside Ray's workers, which import it themselves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.io.inputs.cells import invalid_cells
from batchgen.io.inputs.discovery import InputFile
from batchgen.io.inputs.readers import iter_batches, read_schema
from batchgen.jobs.pipeline.batch_columns import COMMITTED_HASH, INVALID, ROW_ID, SOURCE_PATH, SOURCE_ROW

MODEL_FINGERPRINT = "__batchgen_model_fingerprint"  # JSON of the actor's model fingerprint, every row


@dataclass(slots=True)
class ReadSpec:
    """What a read task needs to turn one input file into rows: shipped once to the workers."""

    files: list[InputFile]
    labels: list[str]  # per file: the derived ids' file label (batchgen.jobs.rows.rows._file_labels)
    num_rows: list[int]  # per file: rows this run reads (the scan applied --max-rows)
    columns: list[str]  # the columns the job reads, in RowSource.read_columns order
    schema: pa.Schema  # those columns' types unified over the files, so every block has one schema
    id_column: str | None
    id_type: pa.DataType  # the id column's type, or string for derived ids
    read_batch_size: int
    skip: Any  # ObjectRef of the set of ids to leave out (settled), resolved once per worker
    hashes: Any  # ObjectRef of {id: committed prompt hash} to compare (--id-column), or None


_resolved: dict[int, Any] = {}  # id(ObjectRef) -> its value, per worker process


def _get(ref: Any) -> Any:
    if ref is None:
        return None
    key = id(ref)
    if key not in _resolved:
        import ray  # inside a Ray worker: installed and connected

        _resolved.clear()  # one job per worker at a time: older values are garbage
        _resolved[key] = ray.get(ref)
    return _resolved[key]


def read_file(batch: dict[str, Any], spec: ReadSpec) -> Iterator[pa.Table]:
    """map_batches function (batch_size=1): the file index in `batch` -> tables of its unsettled rows."""
    skip = _get(spec.skip) or set()
    hashes = _get(spec.hashes)
    for index in batch["file"]:
        yield from _read_input_file(spec, int(index), skip, hashes)


def _read_input_file(spec: ReadSpec, index: int, skip: set, hashes: dict | None) -> Iterator[pa.Table]:
    file, label, limit = spec.files[index], spec.labels[index], spec.num_rows[index]
    if limit <= 0:
        return
    num_read = 0  # rows of this file read so far; its rows may be a range of the file (a sharded job's share)
    present = set(read_schema(file).names)  # a passthrough column this file lacks is null in its rows
    columns = [c for c in spec.columns if c in present]
    for batch in iter_batches(file, columns, spec.read_batch_size):
        batch = batch.slice(0, limit - num_read)
        row_index = file.first_row + num_read  # ids and the manifest count rows from the file's start
        invalid = invalid_cells(batch)
        if spec.id_column:
            ids = batch.column(batch.schema.get_field_index(spec.id_column)).to_pylist()
        else:
            ids = [f"{label}:{row_index + i}" for i in range(batch.num_rows)]
        keep = [i for i, row_id in enumerate(ids) if row_id not in skip]
        if keep:
            # whole: Ray Data merges a task's output into big blocks anyway, and the driver splits
            # them into actor batches after the read (batchgen.jobs.executors.ray.driver._split_blocks)
            yield _table(spec, batch, ids, keep, row_index, invalid, file.path, hashes)
        num_read += batch.num_rows
        if num_read >= limit:
            return


def _table(spec: ReadSpec, batch: pa.RecordBatch, ids: list, keep: list[int], first_row: int,
           invalid: dict[int, str], path: str, hashes: dict | None) -> pa.Table:
    """The kept rows with every read column in its unified type (null where this file lacks it)."""
    taken = batch.take(pa.array(keep, pa.int64()))
    arrays, fields = [], []
    for f in spec.schema:
        index = taken.schema.get_field_index(f.name)
        column = taken.column(index).cast(f.type) if index >= 0 else pa.nulls(len(keep), f.type)
        arrays.append(column)
        fields.append(f)
    kept_ids = [ids[i] for i in keep]
    extra = [
        (pa.field(ROW_ID, spec.id_type), pa.array(kept_ids, spec.id_type)),
        (pa.field(SOURCE_PATH, pa.string()), pa.array([path] * len(keep), pa.string())),
        (pa.field(SOURCE_ROW, pa.int64()), pa.array([first_row + i for i in keep], pa.int64())),
        (pa.field(INVALID, pa.string()), pa.array([invalid.get(i) for i in keep], pa.string())),
        (pa.field(COMMITTED_HASH, pa.string()),
         pa.array([hashes.get(i) if hashes else None for i in kept_ids], pa.string())),
    ]
    for f, array in extra:
        fields.append(f)
        arrays.append(array)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


class GenerateActor:
    """map_batches actor class: one BatchGenerator (one loaded model) per actor."""

    def __init__(self, config: JobConfig, schema: pa.Schema):
        import logging

        from batchgen.jobs.encoding.task_setup import batch_generator_for

        logging.getLogger("batchgen").setLevel(logging.WARNING)  # the driver logs the job
        self.generate = batch_generator_for(config, schema=schema)  # the task's (generate, embed, ...)
        self.fingerprint = json.dumps(self.generate.model_fingerprint, sort_keys=True)

    def __call__(self, table: pa.Table) -> pa.Table:
        out = self.generate(table)
        return out.append_column(pa.field(MODEL_FINGERPRINT, pa.string()),
                                 pa.array([self.fingerprint] * out.num_rows, pa.string()))
