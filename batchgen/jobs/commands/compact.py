"""`batchgen compact`: rewrite a finished output directory as one part per input file, in input order.

A job writes parts in commit order and rows within a part in finishing order; downstream tools
that want input order, or fewer files, run this once the job is complete (`_SUCCESS`). Each
committed row's input file and row index are in the manifest (hidden bookkeeping, not output
columns), so no input file is read.

It is a commit like any other (batchgen.io.manifest.manifest): the new parts are staged, one "compact"
entry adds them and removes every old part, then they are published. A crash before the entry
leaves the old output; after it, the next `batchgen run` or `compact` finishes publishing.
`_SUCCESS` is removed before the entry and written again at the end; a job that wrote the OpenAI
Batch API files (batchgen.jobs.openai.output) gets them written again, in input order, before it.
Needs free disk space for one more copy of the output while it runs; memory is bounded by
CHUNK_ROWS rows and a few row groups (batchgen.io.store.writers.ROW_GROUP_ROWS rows each): a part is read
a row group at a time, on an object store too, never whole.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import (
    SUCCESS_FILE,
    Manifest,
    PartRecord,
    check_parts_present,
    clear_success,
    fingerprint_digest,
    is_job_dir,
    load_manifest,
    write_success,
)
from batchgen.io.store.factory import open_store
from batchgen.io.store.schema import SAMPLE_INDEX
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.openai.output import SUCCESS_KEY, recorded_batch_files, write_batch_files
from batchgen.jobs.sharding.finalize import check_shards, finalize_locked
from batchgen.jobs.sharding.sharded import is_sharded_output, output_location

log = logging.getLogger("batchgen")

CHUNK_ROWS = 8192  # rows gathered per row group of a compacted part
PART_CACHE = 4  # source parts held open at once, and row groups held decoded


@dataclass(slots=True)
class CompactSummary:
    output_dir: str
    num_parts_before: int
    num_parts_after: int
    num_rows: int


def compact_output(out_dir: str | Path | OutputStore) -> CompactSummary:
    store = open_store(out_dir)
    out_dir = store.path() if isinstance(store, LocalStore) else store
    if not is_job_dir(store):
        if is_sharded_output(store):  # each shard compacted; the job's _SUCCESS written again
            return compact_sharded(store)
        raise OutputError(f"{out_dir} is not a batchgen output directory (it has no _manifest)")
    with store.lock() as lock:
        manifest = Manifest(store, load_manifest(store, keep_rows=True, keep_hashes=True), guard=lock)
        if manifest.recover():
            raise OutputError(f"{out_dir} has missing or damaged parts; run the job again to regenerate them")
        state = manifest.state
        if not store.exists(SUCCESS_FILE):
            raise OutputError(f"{out_dir} is not complete (no {SUCCESS_FILE}); finish the job first "
                              "(`batchgen status` shows what remains)")
        before = len(state.parts)
        batch_files = recorded_batch_files(store)  # --output-format openai-batch / both
        if state.last_op == "compact" or not state.parts:
            return CompactSummary(str(out_dir), before, before, state.num_committed_rows)
        rows_by_file: dict[str, list[tuple[int, str, int]]] = {}  # input file path -> [(row, part, position)]
        for record in state.parts.values():
            assert record.files is not None and record.rows is not None
            for position, (path, row) in enumerate(zip(record.files, record.rows, strict=True)):
                rows_by_file.setdefault(path, []).append((row, record.name, position))
        listed = [s["path"] for s in state.inputs["inputs"]] if state.inputs else []
        order = [p for p in listed if p in rows_by_file] + sorted(set(rows_by_file) - set(listed))
        first = next(iter(state.parts))
        schema = store.read_schema(first)
        writer = PartWriter(store, schema)
        with_samples = SAMPLE_INDEX in schema.names
        samples = _SampleRows(store) if with_samples else None
        reader = _PartReader(store)
        tag = f".{state.last_seq + 1:08d}"
        errors = state.error_ids
        staged = []
        try:
            for path in order:
                items = sorted(rows_by_file[path])
                # a row of several samples is that many rows of its part, its samples in order
                rows = items if samples is None else [(row, name, file_row) for row, name, position in items
                                                      for file_row in samples.of(name, position)]
                part = writer.stage_tables(reader.gather(rows), tag=tag)
                ids = [state.parts[name].ids[pos] for _, name, pos in items]
                hashes = [state.prompt_hashes.get(i) for i in ids] if state.prompt_hashes else None
                staged.append((part, PartRecord.staged(part, ids, [i in errors for i in ids], [path] * len(items),
                                                       [row for row, _, _ in items], hashes,
                                                       with_samples=with_samples)))
        except BaseException:
            for part, _ in staged:
                part.discard()
            raise
        manifest.commit(staged, list(state.parts), op="compact")  # removes _SUCCESS first
        success = {"rows": state.num_committed_rows, "rows_error": len(state.error_ids),
                   "fingerprint": fingerprint_digest(state.fingerprint), "compacted": True}
        manifest.sweep()  # _SUCCESS vouches for the listing (Manifest.sweep)
        if batch_files is not None:  # written again, now in input order, before _SUCCESS
            success[SUCCESS_KEY] = write_batch_files(store, manifest.state, batch_files["dir"],
                                                     created=batch_files.get("created"))
        check_parts_present(store, manifest.state)  # and every part _SUCCESS vouches for is there
        write_success(store, success)
        log.info("compacted %d parts into %d", before, len(staged))
        return CompactSummary(str(out_dir), before, len(staged), state.num_committed_rows)


class _SampleRows:
    """The file rows of each input row of a part with a sample_index column: a row starts where the
    index is 0 (or null, an error row's), so one int column per part tells them apart."""

    def __init__(self, store: OutputStore):
        self.store = store
        self.starts: dict[str, array] = {}  # 8 bytes per input row: compact's memory stays bounded

    def of(self, name: str, position: int) -> range:
        starts = self.starts.get(name)
        if starts is None:
            index = self.store.read_table(name, columns=[SAMPLE_INDEX]).column(0).to_pylist()
            starts = self.starts[name] = array("q", [i for i, s in enumerate(index) if not s] + [len(index)])
        return range(starts[position], starts[position + 1])


class _PartReader:
    """Rows of committed parts by position, in chunks: each part opened once (a few at a time) and
    read a row group at a time, with a few row groups cached."""

    def __init__(self, store: OutputStore):
        self.store = store
        self.files: OrderedDict[str, tuple[object, pq.ParquetFile, list[int]]] = OrderedDict()
        self.groups: OrderedDict[tuple[str, int], pa.Table] = OrderedDict()

    def gather(self, items: list[tuple[int, str, int]]) -> Iterator[pa.Table]:
        try:
            for start in range(0, len(items), CHUNK_ROWS):
                chunk = items[start:start + CHUNK_ROWS]
                pieces = []
                run_key, run_positions = None, []
                for _, name, position in chunk:  # consecutive rows from one row group are taken together
                    key = (name, self._group_of(name, position))
                    if key != run_key and run_positions:
                        pieces.append(self._group(*run_key).take(run_positions))
                        run_positions = []
                    run_key = key
                    run_positions.append(position - self._file(name)[2][key[1]])
                if run_positions:
                    pieces.append(self._group(*run_key).take(run_positions))
                yield pa.concat_tables(pieces)
        finally:
            self.close()

    def close(self) -> None:
        for source, _, _ in self.files.values():
            source.close()
        self.files.clear()
        self.groups.clear()

    def _file(self, name: str) -> tuple[object, pq.ParquetFile, list[int]]:
        if name in self.files:
            self.files.move_to_end(name)
            return self.files[name]
        source = self.store.open_input(name)
        parquet = pq.ParquetFile(source)
        starts = [0]
        for i in range(parquet.metadata.num_row_groups):
            starts.append(starts[-1] + parquet.metadata.row_group(i).num_rows)
        self.files[name] = (source, parquet, starts)
        if len(self.files) > PART_CACHE:
            _, (evicted, _, _) = self.files.popitem(last=False)
            evicted.close()
        return self.files[name]

    def _group_of(self, name: str, position: int) -> int:
        return bisect.bisect_right(self._file(name)[2], position) - 1

    def _group(self, name: str, index: int) -> pa.Table:
        key = (name, index)
        if key in self.groups:
            self.groups.move_to_end(key)
            return self.groups[key]
        table = self._file(name)[1].read_row_group(index)
        self.groups[key] = table
        if len(self.groups) > PART_CACHE:
            self.groups.popitem(last=False)
        return table


def compact_sharded(output: str | Path | OutputStore):
    """`batchgen compact` over a finalized sharded job: each shard compacted, then the job's
    _SUCCESS written again. While it runs the job has no _SUCCESS (readers wait, as for one directory)."""
    store = open_store(output)
    output = output_location(store)
    with store.lock():  # the job's own lock, as finalize holds it: never both writing the job's files
        if not store.exists(SUCCESS_FILE):
            raise OutputError(f"{output} is a sharded job not finalized (no {SUCCESS_FILE}); run `batchgen "
                              f"finalize --output {output}` first")
        shards = check_shards(store)  # the set is whole before anything is rewritten
        clear_success(store)
        before = after = rows = 0
        for shard in shards:
            result = compact_output(shard.dir.store)
            before, after = before + result.num_parts_before, after + result.num_parts_after
            rows += result.num_rows
        finalize_locked(store)
    return CompactSummary(str(output), before, after, rows)
