"""What an output directory's manifest says: committed parts, their row ids, the job's config.

`load_manifest` replays the entries in `_manifest/` (batchgen.io.manifest.manifest writes them,
batchgen.io.manifest.entries names and reads them) into a `ManifestState` of PartRecords
(batchgen.io.manifest.part_record); `ManifestState.validate` checks an entry against the state before it is written,
so an entry that would make the manifest unloadable (an id committed twice, a part whose lists
disagree) is never made durable.

Loading starts at the latest snapshot (batchgen.io.manifest.snapshot), so its cost follows the
committed parts and the few entries after the snapshot, not the number of commits ever made.
A part's per-row lists are compact (batchgen.io.ids.compact_lists) and `ok_ids` is an exact index into
them (batchgen.io.ids.index), not a set of id objects: a million committed ids and their index cost
~40 MiB as integer --id-column ids, under 1 MiB as derived ids (runs of row numbers), not ~300 MiB
(benchmarks/scale/id_index_memory.py).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.errors import DamagedSnapshot, OutputError
from batchgen.io.ids.index import IdIndex
from batchgen.io.manifest.entries import (  # re-exported: readers of the state import them from here
    ENTRY_RE,
    FORMAT,
    MANIFEST_DIR,
    EntryVanished,
    entry_epoch,
    entry_name,
    entry_paths,
    fingerprint_digest,
    is_job_dir,
    listed_entries,
    manifest_dir,
    read_entry,
    read_entry_file,
)
from batchgen.io.manifest.part_record import FILE_KEY, FILES_KEY, PartRecord
from batchgen.io.manifest.prompt_hashes import PromptHashes
from batchgen.io.manifest.snapshot import apply_snapshot
from batchgen.io.manifest.snapshot_rows import part_row_lists, part_rows
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import OutputStore

WRITE_OPS = ("commit", "compact", "repair")
# a listing that a consolidation overtook is taken again this many times (with a short, growing
# pause) before a vanished entry counts as damage: a snapshot's drop_before is a few deletes
VANISHED_RETRIES = 8
VANISHED_PAUSE_S = 0.02

__all__ = ["ENTRY_RE", "FORMAT", "MANIFEST_DIR", "EntryVanished", "WRITE_OPS", "ManifestState", "PartRecord",
           "entry_epoch", "entry_name", "entry_paths", "fingerprint_digest", "is_job_dir", "load_manifest",
           "manifest_dir", "part_row_lists", "part_rows", "read_entry", "read_entry_file"]


@dataclass(slots=True)
class ManifestState:
    """The replayed log: committed parts and the ids they hold."""

    fingerprint: dict[str, Any] | None = None
    parts: dict[str, PartRecord] = field(default_factory=dict)
    ok_ids: IdIndex = field(default_factory=IdIndex)  # the committed ok ids (a set), each with its part
    error_ids: dict[Any, str] = field(default_factory=dict)  # id of an error row -> its part's name
    inputs: dict[str, Any] | None = None  # the latest "inputs" entry
    last_seq: int = 0
    begin_seq: int | None = None  # the latest "begin" entry
    snapshot_seq: int | None = None  # the latest snapshot entry
    snapshot_rows: str | None = None  # its rows file's name
    last_commit_time: float | None = None  # unix time of the latest entry that wrote or removed
    last_op: str | None = None
    partials: dict[str, Any] | None = None  # the latest "partials" entry (batchgen.io.manifest.partials)
    keep_hashes: bool = False  # hold each ok row's prompt hash (a resume under --id-column needs them)
    with_ids: bool = True  # False: counts only (status), a snapshot's rows file is not read
    out_dir: OutputStore | None = None  # where a snapshot's rows file is read from
    num_prompt_hashes: int = 0  # ok rows with a prompt hash held (keep_hashes)
    num_rows: int = 0  # rows of every part: a counts-only load (with_ids=False) holds no ids to count
    _hashes_view: PromptHashes | None = field(default=None, repr=False, compare=False)

    @property
    def num_committed_rows(self) -> int:
        return self.num_rows

    @property
    def prompt_hashes(self) -> PromptHashes:
        """ok id -> its prompt hash (with keep_hashes; empty without): a view of the parts' hashes."""
        if self._hashes_view is None:
            self._hashes_view = PromptHashes(self)
        return self._hashes_view

    def validate(self, entry: dict[str, Any]) -> None:
        """Raise AssertionError if applying `entry` would break an invariant; changes nothing.

        Called before an entry is written: a bad entry made durable would fail every later load.
        """
        if entry["op"] not in WRITE_OPS:
            return
        removed = {*entry.get("remove", []), *(p["name"] for p in entry.get("write", []))}
        leaving: set[Any] = set()
        for name in removed:
            record = self.parts.get(name)
            if record is not None:
                leaving.update(record.ids)
        seen: set[Any] = set()
        num_files = len(entry[FILES_KEY])
        for p in entry.get("write", []):
            ids = p["ids"]
            n = p["num_rows"]
            _require(len(ids) == n == len(p[FILE_KEY]) == len(p["row"]), f"part {p['name']}: row lists disagree")
            _require("hashes" not in p or len(p["hashes"]) == n, f"part {p['name']}: hashes disagree")
            _require(all(0 <= i < n for i in p["errors"]), f"part {p['name']}: error position out of range")
            _require(all(0 <= f < num_files for f in p[FILE_KEY]), f"part {p['name']}: input file index out of range")
            for row_id in ids:
                twice = row_id in seen or ((row_id in self.ok_ids or row_id in self.error_ids)
                                           and row_id not in leaving)
                _require(not twice, f"id {row_id!r} would be committed twice (part {p['name']})")
                seen.add(row_id)

    def apply(self, entry: dict[str, Any], *, keep_rows: bool = False) -> None:
        op, seq = entry["op"], entry["seq"]
        if op == "begin":
            self.fingerprint = entry["fingerprint"]
            self._clear()
            self.partials = None  # checkpoints of another config's rows are dead
            self.begin_seq = seq
            self.snapshot_rows = None
        elif op == "inputs":
            self.inputs = entry
        elif op == "fence":  # chains past a superseded job's entries (batchgen.io.manifest.manifest): nothing else
            self.last_seq = seq
            return
        elif op == "partials":
            self.partials = entry
            self.last_seq = seq
            return  # not a write of output rows: last_op stays (batchgen compact reads it)
        elif op == "snapshot":
            self._clear()
            apply_snapshot(self, entry, keep_rows=keep_rows)
            self.snapshot_seq = seq
            self.last_seq = seq
            return  # last_op stays the last write op (batchgen compact reads it)
        elif op in WRITE_OPS:
            written = [PartRecord.from_json(p, seq, entry[FILES_KEY], keep_rows) for p in entry.get("write", [])]
            for name in [*entry.get("remove", []), *(r.name for r in written)]:
                self.drop(name)
            for record in written:
                self.add(record)
            self.last_commit_time = entry["time"]
        else:
            raise OutputError(f"manifest entry {seq} has an unknown op {op!r}; it was written by a newer "
                              "batchgen")
        self.last_seq = seq
        self.last_op = op

    def _clear(self) -> None:
        self.parts, self.ok_ids, self.error_ids, self.num_prompt_hashes, self.num_rows = {}, IdIndex(), {}, 0, 0

    def drop(self, name: str) -> None:
        record = self.parts.pop(name, None)
        if record is None:
            return
        ok_positions = record.ok_positions()
        self.ok_ids.drop_part(name, ok_positions)
        for row_id in record.error_ids:
            del self.error_ids[row_id]
        self.num_prompt_hashes -= _num_hashes(record, ok_positions)
        self.num_rows -= record.num_rows

    def add(self, record: PartRecord, ids: list[Any] | None = None) -> None:
        """Add a part; `ids`: its ids as Python objects where the caller has them (faster). A
        counts-only load adds a snapshot's parts with no ids: counted, and removable by a later entry."""
        if not self.keep_hashes:
            record.hashes = None  # not needed in memory: they stay in the entry
        for row_id in record.error_ids:
            if row_id in self.ok_ids or row_id in self.error_ids:
                _committed_twice(row_id, record)
            self.error_ids[row_id] = record.name
        ok_positions = record.ok_positions()
        if len(ok_positions) + len(record.error_ids) != len(record.ids):  # an ok row with an error row's id
            counts = Counter(record.ids)  # error ids are distinct (above): the one that is also an ok row's
            _committed_twice(next(i for i in record.error_ids if counts[i] > 1), record)
        twice = self.ok_ids.add_part(record, ok_positions, ids)  # an ok id twice, within the part or not
        if twice is None and self.error_ids:
            twice = next((record.ids[i] for i in ok_positions if record.ids[i] in self.error_ids), None)
        if twice is not None:
            _committed_twice(twice, record)
        self.num_prompt_hashes += _num_hashes(record, ok_positions)
        self.num_rows += record.num_rows
        self.parts[record.name] = record

    def part_of(self, ids: set[Any]) -> dict[Any, str]:
        """The part holding each of the committed ok `ids` (from the id index)."""
        found = {row_id: self.ok_ids.part_of(row_id) for row_id in ids}
        return {row_id: name for row_id, name in found.items() if name is not None}

    def check_integrity(self) -> None:
        """Every committed id is in exactly one part; the counts agree."""
        assert sum(r.num_rows for r in self.parts.values()) == self.num_rows == len(self.ok_ids) + len(self.error_ids)
        assert not self.ok_ids & self.error_ids.keys()
        assert self.prompt_hashes.keys() <= self.ok_ids
        for record in self.parts.values():
            assert len(record.ids) == record.num_rows == sum(map(sum, record.file_counts.values())), record.name
            assert len(record.error_ids) == sum(c[1] for c in record.file_counts.values()), record.name
            assert all(self.error_ids[i] == record.name for i in record.error_ids), record.name


def _committed_twice(row_id: Any, record: PartRecord) -> None:
    raise OutputError(f"manifest is damaged: id {row_id!r} is committed twice (part {record.name} and another)")


def _num_hashes(record: PartRecord, ok_positions: list[int]) -> int:
    hashes = record.hashes
    return 0 if hashes is None else sum(hashes[i] is not None for i in ok_positions)


def _require(condition: bool, message: str) -> None:
    if not condition:  # not `assert`: this check must also run under python -O
        raise AssertionError(f"refusing to write a bad manifest entry: {message}")


def load_manifest(out_dir: str | Path | OutputStore, *, keep_rows: bool = False, keep_hashes: bool = False,
                  with_ids: bool = True) -> ManifestState:
    """Replay `_manifest/` from its latest snapshot (an empty state when there is none).

    `with_ids=False` (status): parts carried by a snapshot have their counts but no ids. A reader
    without the lock can see an entry vanish under it (EntryVanished): it lists again, a bounded
    number of times, before it calls the manifest damaged."""
    store = open_store(out_dir)
    for attempt in range(VANISHED_RETRIES + 1):
        try:
            return _replay(store, keep_rows=keep_rows, keep_hashes=keep_hashes, with_ids=with_ids)
        except EntryVanished:
            if attempt == VANISHED_RETRIES:
                raise
            time.sleep(VANISHED_PAUSE_S * (attempt + 1))
    raise AssertionError("unreachable")


def _replay(store: OutputStore, *, keep_rows: bool, keep_hashes: bool, with_ids: bool) -> ManifestState:
    """Replay the chain of entries that ends at the newest: each names the one before it ("prev",
    else seq - 1), back to the oldest listed or to a snapshot or "begin" (before which nothing
    counts). An entry off the chain was written by a job that had lost the lease, and is skipped."""
    state = ManifestState(keep_hashes=keep_hashes, with_ids=with_ids, out_dir=store)
    listed = listed_entries(store)
    chain: list[dict[str, Any]] = []
    seq = max(listed, default=0)
    while seq:
        chain.append(_read(store, seq, listed[seq]))
        prev = chain[-1].get("prev", seq - 1)
        if prev < min(listed) or (prev not in listed and chain[-1]["op"] in ("snapshot", "begin")):
            break
        if prev not in listed:
            raise EntryVanished(f"manifest is damaged: entry {prev:08d}.json is missing before {listed[seq]}")
        seq = prev
    since_begin: list[dict[str, Any]] | None = None  # the chain's entries from its last "begin", none summed up
    for entry in reversed(chain):
        try:
            state.apply(entry, keep_rows=keep_rows)
        except DamagedSnapshot:
            # the snapshot sums up the entries before it: where a crash kept them all (the chain
            # reaches back to a "begin") they say the same, so replay them and pass the snapshot over
            if since_begin is None:
                raise
            state = ManifestState(keep_hashes=keep_hashes, with_ids=with_ids, out_dir=store)
            for earlier in since_begin:
                state.apply(earlier, keep_rows=keep_rows)
            state.last_seq = entry["seq"]  # the next entry still comes after the snapshot's number
            continue
        if entry["op"] == "begin":
            since_begin = []
        elif entry["op"] == "snapshot":
            since_begin = None
        if since_begin is not None:
            since_begin.append(entry)
    return state


def _read(store: OutputStore, seq: int, name: str) -> dict[str, Any]:
    entry = read_entry_file(store, name)
    if entry.get("format") != FORMAT or entry.get("seq") != seq:
        raise OutputError(f"manifest entry {store / name} has format {entry.get('format')!r}, seq "
                          f"{entry.get('seq')!r}; it was not written by this batchgen")
    return entry
