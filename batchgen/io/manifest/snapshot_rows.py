"""Reading a manifest snapshot's rows file (batchgen.io.manifest.snapshot writes it): streamed a
few thousand rows at a time and checked against the sha256 its entry recorded, and the per-row
lists (input file, row index, prompt hash) of any committed part, from its entry or its snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import DamagedSnapshot, OutputError
from batchgen.io.manifest.entries import MANIFEST_DIR, read_entry
from batchgen.io.manifest.part_record import FILE_KEY, FILES_KEY, PartRecord
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import OutputStore

_READ_BATCH_ROWS = 1 << 13


class RowLists:
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
        self.reader: RowsReader | None = None
        self.position = 0  # the reader's next row

    def of(self, record: PartRecord) -> tuple[list[str], list[int], list[str | None] | None]:
        if record.files is not None and record.rows is not None and record.hashes is not None:
            return record.files, record.rows, record.hashes
        if record.seq not in self.entries:
            entry = read_entry(self.out_dir, record.seq)
            self.entries = {seq: e for seq, e in self.entries.items() if e[0]["op"] == "snapshot"}
            self.entries[record.seq] = (entry, {p["name"]: p for p in entry.get("write", entry.get("parts", []))})
        entry, parts = self.entries[record.seq]
        if entry["op"] != "snapshot":
            p = parts[record.name]
            return [entry[FILES_KEY][i] for i in p[FILE_KEY]], p["row"], p.get("hashes")
        if self.offsets is None:
            self.offsets, start = {}, 0
            for p in entry["parts"]:
                self.offsets[p["name"]] = (start, p["num_rows"])
                start += p["num_rows"]
        start, n = self.offsets[record.name]
        rows = self._take(entry, start, n)
        hashes = rows["hash"]
        return ([entry[FILES_KEY][i] for i in rows[FILE_KEY]], rows["row"],
                None if all(h is None for h in hashes) else hashes)

    def _take(self, entry: dict[str, Any], start: int, n: int) -> dict[str, list[Any]]:
        if self.reader is None or start < self.position:  # first use, or (never seen) out of order
            self.close()
            self.reader, self.position = RowsReader(self.out_dir, entry, [FILE_KEY, "row", "hash"]), 0
        self.reader.skip(start - self.position)
        self.position = start + n
        return self.reader.take(n)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


class RowsReader:
    """A snapshot's rows file read in order, a few thousand rows at a time, only `columns`: the
    decoded file never sits in memory whole (Arrow's allocator keeps what it once held)."""

    def __init__(self, out_dir: OutputStore | None, entry: dict[str, Any], columns: list[str]):
        assert out_dir is not None, "a snapshot's rows are read from its directory"
        self.store, self.name = open_store(out_dir), f"{MANIFEST_DIR}/{entry['rows']['name']}"
        self.columns = columns
        check_digest(self.store, self.name, entry)
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


def check_digest(store: OutputStore, name: str, entry: dict[str, Any]) -> None:
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


def read_rows(out_dir: OutputStore | None, entry: dict[str, Any]) -> pa.Table:
    assert out_dir is not None, "a snapshot's rows are read from its directory"
    store = open_store(out_dir)
    path = store / f"{MANIFEST_DIR}/{entry['rows']['name']}"
    check_digest(store, f"{MANIFEST_DIR}/{entry['rows']['name']}", entry)
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
    """(input file path, row index, prompt hash) per row of part `name`, carried over by snapshot `entry`."""
    index = next(i for i, p in enumerate(entry["parts"]) if p["name"] == name)
    table = read_rows(open_store(out_dir), entry)
    table = table.filter(pc.equal(table.column("part"), index))
    files = entry[FILES_KEY]
    hashes = table.column("hash").to_pylist()
    return ([files[i] for i in table.column(FILE_KEY).to_pylist()], table.column("row").to_pylist(),
            None if all(h is None for h in hashes) else hashes)


def part_rows(out_dir: str | Path | OutputStore, record: PartRecord) -> tuple[list[str], list[int]]:
    """(input file path, input row index) per row of a committed part, from its entry."""
    if record.files is not None and record.rows is not None:
        return record.files, record.rows
    return part_row_lists(out_dir, record)[:2]


def part_row_lists(out_dir: str | Path | OutputStore,
                   record: PartRecord) -> tuple[list[str], list[int], list[str | None] | None]:
    """(input file path, row index, prompt hash or None) per row of a committed part, from its entry."""
    entry = read_entry(out_dir, record.seq)
    if entry["op"] == "snapshot":  # a part carried over by a snapshot: its rows are in the snapshot's file
        return snapshot_part(out_dir, entry, record.name)
    p = next(p for p in entry["write"] if p["name"] == record.name)
    return [entry[FILES_KEY][i] for i in p[FILE_KEY]], p["row"], p.get("hashes")
