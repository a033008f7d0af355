"""Manifest snapshots: the whole committed state in one entry, so start-up costs O(parts), not O(commits).

Without them a long job leaves one entry per commit, and every start and every `batchgen status`
replays them all. Every SNAPSHOT_EVERY_ENTRIES entries the writer (batchgen.io.manifest.manifest) writes:

    _manifest/NNNNNNNN.rows.parquet   per committed row: part index, id, error flag, input file
                                      index, input row index, prompt hash (temp + fsync + rename)
    _manifest/NNNNNNNN.json           {"op": "snapshot", "fingerprint", "begin_seq", "inputs",
                                      "last_commit_time", "last_write_op", "shards": [paths],
                                      "parts": [{"name", "temp", "num_rows", "num_bytes", "sha256",
                                      "shard_counts": [[input file index, ok rows, error rows], ...]}],
                                      "rows": {"name", "num_rows", "num_bytes", "sha256"}}

then deletes the entries before it (oldest first, so a crash leaves a contiguous suffix) and the
previous snapshot's rows file. A load checks the rows file against the entry's sha256 before it
reads a row; a damaged one (DamagedSnapshot) is passed over where the entries before the snapshot
are all still there (batchgen.io.manifest.state.load_manifest), else the directory is refused.
The entry is the commit point as always: a rows file no entry
names is garbage, which the writer deletes (`stale_rows_files`). A reader that needs counts only
(status) does not open the rows file: per-part counts are in the entry. Reading the rows file, and a
committed part's per-row lists: batchgen.io.manifest.snapshot_rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import OutputError
from batchgen.io.manifest.entries import MANIFEST_DIR
from batchgen.io.manifest.part_record import FILE_COUNTS_KEY, FILE_KEY, FILES_KEY, PartRecord
from batchgen.io.manifest.snapshot_rows import RowLists, RowsReader
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import OutputStore

if TYPE_CHECKING:
    from batchgen.io.manifest.state import ManifestState

SNAPSHOT_EVERY_ENTRIES = 64  # a load replays at most this many entries after the snapshot
ROWS_SUFFIX = ".rows.parquet"
_ROW_GROUP_ROWS = 1 << 16


def rows_file_name(seq: int) -> str:
    return f"{seq:08d}{ROWS_SUFFIX}"


def snapshot_payload(out_dir: OutputStore, state: ManifestState, seq: int) -> dict[str, Any]:
    """Write the rows file of a snapshot at `seq` (durable) and return the entry's payload."""
    store = open_store(out_dir)
    file_index: dict[str, int] = {}
    parts = []
    for record in state.parts.values():
        counts = [[file_index.setdefault(path, len(file_index)), ok, err]
                  for path, (ok, err) in record.file_counts.items()]
        parts.append({"name": record.name, "temp": record.temp, "num_rows": record.num_rows,
                      "num_bytes": record.num_bytes, "sha256": record.sha256, FILE_COUNTS_KEY: counts})
    name = rows_file_name(seq)
    path = f"{MANIFEST_DIR}/{name}"
    counted: list[int] = []
    try:  # whole or absent (temp + fsync + rename + directory fsync, or one PUT); the entry commits it
        store.place(path, lambda file: counted.append(_write_rows(store, state, file_index, file)))
    except OSError as e:
        raise OutputError(f"cannot write the manifest snapshot {store / path}: {e.strerror or e}") from e
    num_rows = counted[0]
    num_bytes, sha256 = store.digest(path)
    return {"fingerprint": state.fingerprint, "begin_seq": state.begin_seq, "inputs": state.inputs,
            "last_commit_time": state.last_commit_time, "last_write_op": state.last_op,
            "partials": state.partials,  # in-flight checkpoints outlive the entries a snapshot drops
            FILES_KEY: list(file_index), "parts": parts,
            "rows": {"name": name, "num_rows": num_rows, "num_bytes": num_bytes, "sha256": sha256}}


def _write_rows(store: OutputStore, state: ManifestState, file_index: dict[str, int], temp) -> int:
    """Stream every part's rows into the file `temp`, a few parts per row group: bounded memory."""
    source = RowLists(store)
    try:
        return _stream_rows(state, file_index, temp, source)
    finally:
        source.close()
        pa.default_memory_pool().release_unused()  # the encoders' buffers: back to the system, not kept


def _stream_rows(state: ManifestState, file_index: dict[str, int], temp, source: RowLists) -> int:
    id_type = None
    writer = None
    pending: list[pa.Table] = []
    num_pending = num_rows = 0
    for part_index, record in enumerate(state.parts.values()):
        files, rows, hashes = source.of(record)
        errors = set(record.error_ids)
        ids = pa.array(list(record.ids))
        id_type = id_type or ids.type
        pending.append(pa.table({
            "part": pa.array([part_index] * record.num_rows, pa.int32()), "id": ids.cast(id_type),
            "error": pa.array([i in errors for i in record.ids], pa.bool_()),
            FILE_KEY: pa.array([file_index[f] for f in files], pa.int32()), "row": pa.array(rows, pa.int64()),
            "hash": pa.array(list(hashes) if hashes is not None else [None] * record.num_rows, pa.string())}))
        num_pending += record.num_rows
        if num_pending >= _ROW_GROUP_ROWS:
            writer = _flush(writer, pending, temp)
            num_rows += num_pending
            pending, num_pending = [], 0
    if pending or writer is None:
        writer = _flush(writer, pending or [_empty()], temp)
        num_rows += num_pending
    writer.close()  # the store syncs the file
    return num_rows


def _empty() -> pa.Table:
    return pa.table({"part": pa.array([], pa.int32()), "id": pa.array([], pa.string()),
                     "error": pa.array([], pa.bool_()), FILE_KEY: pa.array([], pa.int32()),
                     "row": pa.array([], pa.int64()), "hash": pa.array([], pa.string())})


def _flush(writer: pq.ParquetWriter | None, tables: list[pa.Table], temp) -> pq.ParquetWriter:
    table = pa.concat_tables(tables)
    if writer is None:
        # dictionaries only where values repeat: on the unique ids, hashes and row numbers a dictionary
        # is built, overflows and is thrown away on every row group (time and transient memory)
        writer = pq.ParquetWriter(temp, table.schema, compression="zstd", use_dictionary=["part", FILE_KEY])
    writer.write_table(table.cast(writer.schema))
    return writer


def apply_snapshot(state: ManifestState, entry: dict[str, Any], *, keep_rows: bool) -> None:
    """Set `state` (cleared) to the snapshot's. `state.with_ids=False` (status): counts only, the
    rows file is not read."""
    seq, out_dir, with_ids = entry["seq"], state.out_dir, state.with_ids
    files = entry[FILES_KEY]
    state.fingerprint = entry["fingerprint"]
    state.begin_seq = entry["begin_seq"]
    state.inputs = entry["inputs"]
    state.last_commit_time = entry["last_commit_time"]
    state.partials = entry.get("partials")  # absent in snapshots written before partial checkpoints
    if with_ids:
        state.ok_ids.reserve(entry["rows"]["num_rows"])  # hashed ids: one table size, not a rehash every doubling
    columns = ["part", "id", "error", *(["hash"] if state.keep_hashes else []),
               *([FILE_KEY, "row"] if keep_rows else [])]
    reader = RowsReader(out_dir, entry, columns) if with_ids else None
    for p in entry["parts"]:
        n = p["num_rows"]
        counts = {files[i]: [ok, err] for i, ok, err in p[FILE_COUNTS_KEY]}
        if reader is None:  # through add(): counted, and known to the id index should a later entry drop it
            state.add(PartRecord(p["name"], p["temp"], seq, n, p["num_bytes"], p["sha256"], [], [], counts))
            continue
        rows = reader.take(n)  # one part's rows as Python objects at a time: never the whole file's
        assert rows["part"] == [len(state.parts)] * n, f"snapshot rows out of order at {p['name']}"
        ids = rows["id"]
        error_ids = [i for i, e in zip(ids, rows["error"], strict=True) if e]
        record = PartRecord(p["name"], p["temp"], seq, n, p["num_bytes"], p["sha256"], ids, error_ids, counts,
                            hashes=rows.get("hash"))
        if keep_rows:
            record.files = [files[i] for i in rows[FILE_KEY]]
            record.rows = rows["row"]
        state.add(record, ids)
    if reader is not None:
        reader.close()
    state.last_op = entry.get("last_write_op")
    state.snapshot_rows = entry["rows"]["name"]


def stale_rows_files(out_dir: str | Path | OutputStore, keep: str | None) -> list[str]:
    """The rows files other than `keep` (the latest snapshot's), superseded or never committed, by
    their names in the store: the writer deletes them (batchgen.io.manifest.manifest.drop_before)."""
    names = open_store(out_dir).list(MANIFEST_DIR)
    return [f"{MANIFEST_DIR}/{name}" for name in sorted(names) if name.endswith(ROWS_SUFFIX) and name != keep]
