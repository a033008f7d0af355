"""Manifest snapshots: the whole committed state in one entry, so start-up costs O(parts), not O(commits).

Without them a long job leaves one entry per commit, and every start and every `batchgen status`
replays them all. Every SNAPSHOT_EVERY_ENTRIES entries the writer (batchgen.io.manifest.manifest) writes:

    _manifest/NNNNNNNN.rows.parquet   per committed row: part index, id, error flag, input shard
                                      index, input row index, prompt hash (temp + fsync + rename)
    _manifest/NNNNNNNN.json           {"op": "snapshot", "fingerprint", "begin_seq", "inputs",
                                      "last_commit_time", "last_write_op", "shards": [paths],
                                      "parts": [{"name", "temp", "num_rows", "num_bytes", "sha256",
                                      "shard_counts": [[shard index, ok rows, error rows], ...]}],
                                      "rows": {"name", "num_rows", "num_bytes", "sha256"}}

then deletes the entries before it (oldest first, so a crash leaves a contiguous suffix) and the
previous snapshot's rows file. A load checks the rows file against the entry's sha256 before it
reads a row; a damaged one (DamagedSnapshot) is passed over where the entries before the snapshot
are all still there (batchgen.io.manifest.state.load_manifest), else the directory is refused.
The entry is the commit point as always: a rows file no entry
names is garbage, which `clean_rows_files` deletes. A reader that needs counts only (status)
does not open the rows file: per-part counts are in the entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import DamagedSnapshot, OutputError
from batchgen.io.manifest.entries import MANIFEST_DIR, read_entry
from batchgen.io.manifest.part_record import PartRecord
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import OutputStore

if TYPE_CHECKING:
    from batchgen.io.manifest.state import ManifestState

SNAPSHOT_EVERY_ENTRIES = 64  # a load replays at most this many entries after the snapshot
ROWS_SUFFIX = ".rows.parquet"
_ROW_GROUP_ROWS = 1 << 16
_READ_BATCH_ROWS = 1 << 13


def rows_file_name(seq: int) -> str:
    return f"{seq:08d}{ROWS_SUFFIX}"


def snapshot_payload(out_dir: OutputStore, state: ManifestState, seq: int) -> dict[str, Any]:
    """Write the rows file of a snapshot at `seq` (durable) and return the entry's payload."""
    store = open_store(out_dir)
    shard_index: dict[str, int] = {}
    parts = []
    for record in state.parts.values():
        counts = [[shard_index.setdefault(path, len(shard_index)), ok, err]
                  for path, (ok, err) in record.shard_counts.items()]
        parts.append({"name": record.name, "temp": record.temp, "num_rows": record.num_rows,
                      "num_bytes": record.num_bytes, "sha256": record.sha256, "shard_counts": counts})
    name = rows_file_name(seq)
    path = f"{MANIFEST_DIR}/{name}"
    counted: list[int] = []
    try:  # whole or absent (temp + fsync + rename + directory fsync, or one PUT); the entry commits it
        store.place(path, lambda file: counted.append(_write_rows(store, state, shard_index, file)))
    except OSError as e:
        raise OutputError(f"cannot write the manifest snapshot {store / path}: {e.strerror or e}") from e
    num_rows = counted[0]
    num_bytes, sha256 = store.digest(path)
    return {"fingerprint": state.fingerprint, "begin_seq": state.begin_seq, "inputs": state.inputs,
            "last_commit_time": state.last_commit_time, "last_write_op": state.last_op,
            "partials": state.partials,  # in-flight checkpoints outlive the entries a snapshot drops
            "shards": list(shard_index), "parts": parts,
            "rows": {"name": name, "num_rows": num_rows, "num_bytes": num_bytes, "sha256": sha256}}


def _write_rows(store: OutputStore, state: ManifestState, shard_index: dict[str, int], temp) -> int:
    """Stream every part's rows into the file `temp`, a few parts per row group: bounded memory."""
    source = _RowLists(store)
    try:
        return _stream_rows(state, shard_index, temp, source)
    finally:
        source.close()
        pa.default_memory_pool().release_unused()  # the encoders' buffers: back to the system, not kept


def _stream_rows(state: ManifestState, shard_index: dict[str, int], temp, source: _RowLists) -> int:
    id_type = None
    writer = None
    pending: list[pa.Table] = []
    num_pending = num_rows = 0
    for part_index, record in enumerate(state.parts.values()):
        shards, rows, hashes = source.of(record)
        errors = set(record.error_ids)
        ids = pa.array(list(record.ids))
        id_type = id_type or ids.type
        pending.append(pa.table({
            "part": pa.array([part_index] * record.num_rows, pa.int32()), "id": ids.cast(id_type),
            "error": pa.array([i in errors for i in record.ids], pa.bool_()),
            "shard": pa.array([shard_index[s] for s in shards], pa.int32()), "row": pa.array(rows, pa.int64()),
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


class _RowLists:
    """Per-row lists of committed parts, each entry and the previous snapshot's rows read once."""

    def __init__(self, out_dir: OutputStore):
        self.out_dir = out_dir
        # the last entry read, and the previous snapshot's: a commit's parts sit together in the
        # state's order, so one entry at a time reads each once (holding all 64 since the last
        # snapshot cost ~12 MiB of JSON objects at 1,000 rows a part)
        self.entries: dict[int, tuple[dict[str, Any], dict[str, dict]]] = {}  # seq -> (entry, parts by name)
        # the previous snapshot's rows, streamed: its parts come back in its own order (later parts
        # are appended, removed ones leave gaps), so one pass with skips reads it; the whole table
        # in memory was the peak of a 1M-row job (Arrow's allocator keeps what it once held)
        self.offsets: dict[str, tuple[int, int]] | None = None  # part name -> (first row, num rows)
        self.reader: _RowsReader | None = None
        self.position = 0  # the reader's next row

    def of(self, record: PartRecord) -> tuple[list[str], list[int], list[str | None] | None]:
        if record.shards is not None and record.rows is not None and record.hashes is not None:
            return record.shards, record.rows, record.hashes
        if record.seq not in self.entries:
            entry = read_entry(self.out_dir, record.seq)
            self.entries = {seq: e for seq, e in self.entries.items() if e[0]["op"] == "snapshot"}
            self.entries[record.seq] = (entry, {p["name"]: p for p in entry.get("write", entry.get("parts", []))})
        entry, parts = self.entries[record.seq]
        if entry["op"] != "snapshot":
            p = parts[record.name]
            return [entry["shards"][i] for i in p["shard"]], p["row"], p.get("hashes")
        if self.offsets is None:
            self.offsets, start = {}, 0
            for p in entry["parts"]:
                self.offsets[p["name"]] = (start, p["num_rows"])
                start += p["num_rows"]
        start, n = self.offsets[record.name]
        rows = self._take(entry, start, n)
        hashes = rows["hash"]
        return ([entry["shards"][i] for i in rows["shard"]], rows["row"],
                None if all(h is None for h in hashes) else hashes)

    def _take(self, entry: dict[str, Any], start: int, n: int) -> dict[str, list[Any]]:
        if self.reader is None or start < self.position:  # first use, or (never seen) out of order
            self.close()
            self.reader, self.position = _RowsReader(self.out_dir, entry, ["shard", "row", "hash"]), 0
        self.reader.skip(start - self.position)
        self.position = start + n
        return self.reader.take(n)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def _empty() -> pa.Table:
    return pa.table({"part": pa.array([], pa.int32()), "id": pa.array([], pa.string()),
                     "error": pa.array([], pa.bool_()), "shard": pa.array([], pa.int32()),
                     "row": pa.array([], pa.int64()), "hash": pa.array([], pa.string())})


def _flush(writer: pq.ParquetWriter | None, tables: list[pa.Table], temp) -> pq.ParquetWriter:
    table = pa.concat_tables(tables)
    if writer is None:
        # dictionaries only where values repeat: on the unique ids, hashes and row numbers a dictionary
        # is built, overflows and is thrown away on every row group (time and transient memory)
        writer = pq.ParquetWriter(temp, table.schema, compression="zstd", use_dictionary=["part", "shard"])
    writer.write_table(table.cast(writer.schema))
    return writer


def apply_snapshot(state: ManifestState, entry: dict[str, Any], *, keep_rows: bool) -> None:
    """Set `state` (cleared) to the snapshot's. `state.with_ids=False` (status): counts only, the
    rows file is not read."""
    seq, out_dir, with_ids = entry["seq"], state.out_dir, state.with_ids
    shards = entry["shards"]
    state.fingerprint = entry["fingerprint"]
    state.begin_seq = entry["begin_seq"]
    state.inputs = entry["inputs"]
    state.last_commit_time = entry["last_commit_time"]
    state.partials = entry.get("partials")  # absent in snapshots written before partial checkpoints
    if with_ids:
        state.ok_ids.reserve(entry["rows"]["num_rows"])  # hashed ids: one table size, not a rehash every doubling
    columns = ["part", "id", "error", *(["hash"] if state.keep_hashes else []),
               *(["shard", "row"] if keep_rows else [])]
    reader = _RowsReader(out_dir, entry, columns) if with_ids else None
    for p in entry["parts"]:
        n = p["num_rows"]
        counts = {shards[i]: [ok, err] for i, ok, err in p["shard_counts"]}
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
            record.shards = [shards[i] for i in rows["shard"]]
            record.rows = rows["row"]
        state.add(record, ids)
    if reader is not None:
        reader.close()
    state.last_op = entry.get("last_write_op")
    state.snapshot_rows = entry["rows"]["name"]


class _RowsReader:
    """A snapshot's rows file read in order, a few thousand rows at a time, only `columns`: the
    decoded file never sits in memory whole (Arrow's allocator keeps what it once held)."""

    def __init__(self, out_dir: OutputStore | None, entry: dict[str, Any], columns: list[str]):
        assert out_dir is not None, "a snapshot's rows are read from its directory"
        self.store, self.name = open_store(out_dir), f"{MANIFEST_DIR}/{entry['rows']['name']}"
        self.columns = columns
        _check_digest(self.store, self.name, entry)
        try:
            self.file = self.store.open_input(self.name)
            parquet = pq.ParquetFile(self.file)
            num_rows = parquet.metadata.num_rows
        except (OSError, pa.ArrowInvalid) as e:
            self._damaged(e)
        if num_rows != entry["rows"]["num_rows"]:
            raise OutputError(f"manifest snapshot rows {self.store / self.name} hold {num_rows} rows, not "
                              f"{entry['rows']['num_rows']}")
        self.batches = parquet.iter_batches(batch_size=_READ_BATCH_ROWS, columns=columns, use_threads=False)
        self.pending: dict[str, list[Any]] = {c: [] for c in columns}
        self.at = 0

    def skip(self, n: int) -> None:
        """Pass over the next `n` rows."""
        while n:
            available = len(self.pending[self.columns[0]]) - self.at
            if available >= n:
                self.at += n
                return
            n -= available
            self.at = len(self.pending[self.columns[0]])
            self._next_batch()

    def take(self, n: int) -> dict[str, list[Any]]:
        """The next `n` rows, column by column."""
        out: dict[str, list[Any]] = {c: [] for c in self.columns}
        while n:
            available = len(self.pending[self.columns[0]]) - self.at
            if not available:
                self._next_batch()
                continue
            k = min(n, available)
            for c in self.columns:
                out[c].extend(self.pending[c][self.at:self.at + k])
            self.at += k
            n -= k
        return out

    def _next_batch(self) -> None:
        try:
            batch = next(self.batches)
        except StopIteration:
            raise OutputError(f"manifest snapshot rows {self.store / self.name} end early") from None
        except (OSError, pa.ArrowInvalid) as e:
            self._damaged(e)
        self.pending, self.at = {c: batch.column(c).to_pylist() for c in self.columns}, 0

    def close(self) -> None:
        self.file.close()
        self.pending = {c: [] for c in self.columns}
        pa.default_memory_pool().release_unused()  # decode buffers: back to the system, not kept

    def _damaged(self, e: Exception):
        raise DamagedSnapshot(f"manifest snapshot rows {self.store / self.name} are unreadable ({e}); the output "
                              "directory is damaged: pass --overwrite to start over") from e


def _check_digest(store: OutputStore, name: str, entry: dict[str, Any]) -> None:
    """The rows file is the one the snapshot entry recorded (its sha256, where recorded): a file
    changed or replaced since would hand the load other ids, which no later check could tell."""
    recorded = entry["rows"].get("sha256")
    if recorded is None:
        return
    try:
        num_bytes, sha256 = store.digest(name)
    except OSError as e:
        raise DamagedSnapshot(f"manifest snapshot rows {store / name} are unreadable ({e}); the output directory "
                              "is damaged: pass --overwrite to start over") from e
    if (num_bytes, sha256) != (entry["rows"].get("num_bytes", num_bytes), recorded):
        raise DamagedSnapshot(f"manifest snapshot rows {store / name} are not the file the snapshot recorded "
                              f"(sha256 {sha256[:16]}, recorded {recorded[:16]}); the output directory is damaged: "
                              "pass --overwrite to start over")


def _read_rows(out_dir: OutputStore | None, entry: dict[str, Any]) -> pa.Table:
    assert out_dir is not None, "a snapshot's rows are read from its directory"
    store = open_store(out_dir)
    path = store / f"{MANIFEST_DIR}/{entry['rows']['name']}"
    _check_digest(store, f"{MANIFEST_DIR}/{entry['rows']['name']}", entry)
    try:
        table = store.read_table(f"{MANIFEST_DIR}/{entry['rows']['name']}")
    except (OSError, pa.ArrowInvalid) as e:
        raise DamagedSnapshot(f"manifest snapshot rows {path} are unreadable ({e}); the output directory is "
                              "damaged: pass --overwrite to start over") from e
    if table.num_rows != entry["rows"]["num_rows"]:
        raise OutputError(f"manifest snapshot rows {path} hold {table.num_rows} rows, not {entry['rows']['num_rows']}")
    return table


def snapshot_part(out_dir: str | Path | OutputStore, entry: dict[str, Any], name: str
                  ) -> tuple[list[str], list[int], list[str | None] | None]:
    """(shard path, row index, prompt hash) per row of part `name`, carried over by snapshot `entry`."""
    index = next(i for i, p in enumerate(entry["parts"]) if p["name"] == name)
    table = _read_rows(open_store(out_dir), entry)
    table = table.filter(pc.equal(table.column("part"), index))
    shards = entry["shards"]
    hashes = table.column("hash").to_pylist()
    return ([shards[i] for i in table.column("shard").to_pylist()], table.column("row").to_pylist(),
            None if all(h is None for h in hashes) else hashes)


def clean_rows_files(out_dir: str | Path | OutputStore, keep: str | None) -> None:
    """Delete rows files other than `keep` (the latest snapshot's): superseded, or never committed."""
    store = open_store(out_dir)
    for name in store.list(MANIFEST_DIR):
        if name.endswith(ROWS_SUFFIX) and name != keep:
            store.delete(f"{MANIFEST_DIR}/{name}")


def part_rows(out_dir: str | Path | OutputStore, record: PartRecord) -> tuple[list[str], list[int]]:
    """(input shard path, input row index) per row of a committed part, from its entry."""
    if record.shards is not None and record.rows is not None:
        return record.shards, record.rows
    return part_row_lists(out_dir, record)[:2]


def part_row_lists(out_dir: str | Path | OutputStore,
                   record: PartRecord) -> tuple[list[str], list[int], list[str | None] | None]:
    """(shard path, row index, prompt hash or None) per row of a committed part, from its entry."""
    entry = read_entry(out_dir, record.seq)
    if entry["op"] == "snapshot":  # a part carried over by a snapshot: its rows are in the snapshot's file
        return snapshot_part(out_dir, entry, record.name)
    p = next(p for p in entry["write"] if p["name"] == record.name)
    return [entry["shards"][i] for i in p["shard"]], p["row"], p.get("hashes")
