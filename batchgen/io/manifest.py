"""The output directory's manifest: which parts are committed, and under which job config.

An output directory holds:

    part-NNNNN-xxxxxxxx.parquet  committed parts: all that pyarrow.dataset (or any reader) sees
    _manifest/NNNNNNNN.json      the commit log: one small JSON file per entry, never changed
    _batchgen.lock               the running job's lock (batchgen.io.lock)
    _SUCCESS                     written last, once every input row has a committed output row
    _summary.json                the last run's counts and throughput
    .part-....tmp                a part written but not (yet) published; never read by anyone

The manifest is the single source of truth; part files follow it. A commit is:

    1. stage   every new part, and every rewritten part, under a hidden temp name, fsynced,
               then fsync the directory, so the temps' names are durable too;
    2. commit  one entry `_manifest/{seq}.json` listing them (temp + fsync + link + dir fsync):
               the commit point;
    3. publish the entry: delete the parts it removes, rename its rewrites over their old
               files, then rename its new parts into place. No fsync: a rename or unlink that a
               power cut undoes is redone by recovery from the durable entry.

A crash before 2 leaves only hidden temps, which recovery deletes: the rows were never committed
and are generated again. A crash after 2 leaves a committed entry whose temps recovery finishes
publishing (roll forward). So a part is visible only once committed, and a crash at any point
neither loses a committed row nor shows one twice. Step 3 removes before it adds: a row that
moves (an error row retried, a compaction) can be missing from the visible output for a moment
while a job runs, never present twice. Readers that must see everything wait for `_SUCCESS`.

Why not the other order (publish, then record)? Then a crash between the two leaves a visible
part no entry knows. Deleting it on the next run works for appends, but a retried error row
lives in two visible parts in that window, and a plain-directory reader cannot tell which one
counts. Why one file per entry rather than an appended JSONL log? An entry written by rename is
whole or absent; an appended line can be torn by a crash and needs checksums and truncation.

Entry payloads (every entry also has "format", "seq", "time"):
    {"op": "begin", "fingerprint": {...}}   a job (re)starts here: earlier parts are all dropped
    {"op": "inputs", "inputs": [{"path", "num_rows"}], "max_rows"}   what the latest run reads
    {"op": "commit" | "compact" | "repair", "shards": [input paths], "write": [part], "remove": [names]}
A part: {"name", "temp", "num_rows", "num_bytes", "sha256", "ids": [...], "errors": [positions of
         its error rows], "shard": [index into "shards", per row], "row": [input row index, per row]}.
"shard" and "row" are hidden bookkeeping for `batchgen compact` (input order) and `status`.
A part named again in "write" replaces the earlier version (a part minus its retried error rows).

Loading replays the entries: memory is O(committed rows) (the set of ids) and the time is
reading the small entry files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.errors import OutputError
from batchgen.io.writers import (
    TEMP_SUFFIX,
    StagedPart,
    fault_point,
    file_digest,
    fsync_dir,
    publish_staged,
    write_json_atomic,
)

log = logging.getLogger(__name__)

MANIFEST_DIR = "_manifest"
SUCCESS_FILE = "_SUCCESS"
FORMAT = 1
PART_NAME_RE = re.compile(r"part-\d{5,}-[0-9a-f]{8}\.parquet")
_ENTRY_RE = re.compile(r"(\d{8})\.json")


@dataclass(slots=True)
class PartRecord:
    name: str
    temp: str  # the hidden name it was staged under; recovery publishes a leftover temp
    seq: int  # the entry that wrote this version of the part (0 until committed)
    num_rows: int
    num_bytes: int
    sha256: str
    ids: list[Any]
    error_ids: list[Any]  # the ids of its error rows
    shard_counts: dict[str, list[int]]  # input shard path -> [ok rows, error rows] from it
    shards: list[str] | None = None  # per row: input shard path (only when loaded with keep_rows)
    rows: list[int] | None = None  # per row: index within its shard (only with keep_rows)

    def to_json(self, shard_index: dict[str, int]) -> dict[str, Any]:
        assert self.shards is not None and self.rows is not None, "a new part carries its rows"
        errors = set(self.error_ids)
        return {"name": self.name, "temp": self.temp, "num_rows": self.num_rows, "num_bytes": self.num_bytes,
                "sha256": self.sha256, "ids": self.ids,
                "errors": [i for i, row_id in enumerate(self.ids) if row_id in errors],
                "shard": [shard_index[s] for s in self.shards], "row": self.rows}

    @classmethod
    def from_json(cls, p: dict[str, Any], seq: int, shard_paths: list[str], keep_rows: bool) -> PartRecord:
        shards = [shard_paths[i] for i in p["shard"]]
        errors = set(p["errors"])
        return cls(p["name"], p["temp"], seq, p["num_rows"], p["num_bytes"], p["sha256"], p["ids"],
                   [p["ids"][i] for i in p["errors"]], _shard_counts(shards, errors),
                   shards if keep_rows else None, p["row"] if keep_rows else None)

    @classmethod
    def staged(cls, staged: StagedPart, ids: list[Any], is_error: list[bool], shards: list[str],
               rows: list[int]) -> PartRecord:
        assert len(ids) == len(is_error) == len(shards) == len(rows) == staged.num_rows
        errors = {i for i, e in enumerate(is_error) if e}
        return cls(staged.final_path.name, staged.temp_path.name, 0, staged.num_rows, staged.num_bytes,
                   staged.sha256, ids, [ids[i] for i in sorted(errors)], _shard_counts(shards, errors),
                   shards, rows)


def _shard_counts(shards: list[str], errors: set[int]) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    for i, shard in enumerate(shards):
        counts.setdefault(shard, [0, 0])[i in errors] += 1
    return counts


@dataclass(slots=True)
class ManifestState:
    """The replayed log: committed parts and the ids they hold."""

    fingerprint: dict[str, Any] | None = None
    parts: dict[str, PartRecord] = field(default_factory=dict)
    ok_ids: set[Any] = field(default_factory=set)
    error_ids: dict[Any, str] = field(default_factory=dict)  # id of an error row -> its part's name
    inputs: dict[str, Any] | None = None  # the latest "inputs" entry
    last_seq: int = 0
    begin_seq: int | None = None  # the latest "begin" entry
    last_commit_time: float | None = None  # unix time of the latest entry that wrote or removed
    last_op: str | None = None

    @property
    def num_committed_rows(self) -> int:
        return len(self.ok_ids) + len(self.error_ids)

    def apply(self, entry: dict[str, Any], *, keep_rows: bool = False) -> None:
        op, seq = entry["op"], entry["seq"]
        if op == "begin":
            self.fingerprint = entry["fingerprint"]
            self.parts, self.ok_ids, self.error_ids = {}, set(), {}
            self.begin_seq = seq
        elif op == "inputs":
            self.inputs = entry
        elif op in ("commit", "compact", "repair"):
            written = [PartRecord.from_json(p, seq, entry["shards"], keep_rows) for p in entry.get("write", [])]
            for name in [*entry.get("remove", []), *(r.name for r in written)]:
                self._drop(name)
            for record in written:
                self._add(record)
            self.last_commit_time = entry["time"]
        else:
            raise OutputError(f"manifest entry {seq} has an unknown op {op!r}; it was written by a newer "
                              "batchgen")
        self.last_seq = seq
        self.last_op = op

    def _drop(self, name: str) -> None:
        record = self.parts.pop(name, None)
        if record is None:
            return
        self.ok_ids.difference_update(record.ids)
        for row_id in record.error_ids:
            del self.error_ids[row_id]

    def _add(self, record: PartRecord) -> None:
        errors = set(record.error_ids)
        for row_id in record.ids:
            if row_id in self.ok_ids or row_id in self.error_ids:
                raise OutputError(f"manifest is damaged: id {row_id!r} is committed twice "
                                  f"(part {record.name} and another)")
            if row_id in errors:
                self.error_ids[row_id] = record.name
            else:
                self.ok_ids.add(row_id)
        self.parts[record.name] = record

    def check_integrity(self) -> None:
        """Every committed id is in exactly one part; the counts agree."""
        assert sum(r.num_rows for r in self.parts.values()) == self.num_committed_rows
        assert not self.ok_ids & self.error_ids.keys()
        for record in self.parts.values():
            assert len(record.ids) == record.num_rows == sum(map(sum, record.shard_counts.values())), record.name
            assert len(record.error_ids) == sum(c[1] for c in record.shard_counts.values()), record.name
            assert all(self.error_ids[i] == record.name for i in record.error_ids), record.name


def manifest_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / MANIFEST_DIR


def is_job_dir(out_dir: str | Path) -> bool:
    return manifest_dir(out_dir).is_dir()


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_manifest(out_dir: str | Path, *, keep_rows: bool = False) -> ManifestState:
    """Replay `_manifest/` (an empty state when there is none)."""
    state = ManifestState()
    for seq, path in _entry_paths(manifest_dir(out_dir)):
        try:
            entry = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:  # an entry is written whole by rename: this is damage
            raise OutputError(f"manifest entry {path} is unreadable ({e}); the output directory is "
                              "damaged: pass --overwrite to start over") from e
        if entry.get("format") != FORMAT or entry.get("seq") != seq:
            raise OutputError(f"manifest entry {path} has format {entry.get('format')!r}, seq "
                              f"{entry.get('seq')!r}; it was not written by this batchgen")
        state.apply(entry, keep_rows=keep_rows)
    return state


def read_entry(out_dir: str | Path, seq: int) -> dict[str, Any]:
    path = manifest_dir(out_dir) / f"{seq:08d}.json"
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise OutputError(f"manifest entry {path} is unreadable ({e})") from e


def part_rows(out_dir: str | Path, record: PartRecord) -> tuple[list[str], list[int]]:
    """(input shard path, input row index) per row of a committed part, from its entry."""
    if record.shards is not None and record.rows is not None:
        return record.shards, record.rows
    entry = read_entry(out_dir, record.seq)
    p = next(p for p in entry["write"] if p["name"] == record.name)
    return [entry["shards"][i] for i in p["shard"]], p["row"]


def _entry_paths(directory: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    entries = sorted((int(m.group(1)), directory / name) for name in names if (m := _ENTRY_RE.fullmatch(name)))
    for (a, _), (b, path) in zip(entries, entries[1:], strict=False):
        if b != a + 1:
            raise OutputError(f"manifest is damaged: entry {a + 1:08d}.json is missing before {path.name}")
    return entries


class Manifest:
    """Appends entries to one output directory's manifest; the caller holds the lock."""

    def __init__(self, out_dir: str | Path, state: ManifestState | None = None):
        self.out_dir = Path(out_dir)
        self.state = state if state is not None else load_manifest(out_dir)

    def append(self, op: str, **payload: Any) -> dict[str, Any]:
        """Write the next entry (the commit point) and apply it to the in-memory state."""
        directory = manifest_dir(self.out_dir)
        if not directory.is_dir():
            try:
                directory.mkdir()
            except OSError as e:
                raise OutputError(f"cannot create {directory}: {e.strerror or e}") from e
            fsync_dir(self.out_dir)
        entry = {"format": FORMAT, "seq": self.state.last_seq + 1, "time": time.time(), "op": op, **payload}
        write_json_atomic(directory / f"{entry['seq']:08d}.json", entry, exclusive=True)
        self.state.apply(entry)
        return entry

    def begin(self, fingerprint: dict[str, Any]) -> None:
        """Start a job: from this entry on, no earlier part counts (and recovery deletes them)."""
        self.append("begin", fingerprint=fingerprint)

    def commit(self, parts: list[tuple[StagedPart, PartRecord]], remove: list[str] = (), *,
               op: str = "commit") -> None:
        """Commit staged parts (new ones and rewrites) and removals, then publish them."""
        if not parts and not remove:
            return
        clear_success(self.out_dir)  # the visible output is about to change
        try:
            fault_point("fsync_staged")
            fsync_dir(self.out_dir)  # the staged temps' names: an entry must never outlive its files
        except OSError as e:
            raise OutputError(f"cannot sync {self.out_dir}: {e.strerror or e}") from e
        shard_paths = sorted({s for _, r in parts for s in r.shards})
        index = {path: i for i, path in enumerate(shard_paths)}
        self.append(op, shards=shard_paths, write=[r.to_json(index) for _, r in parts], remove=list(remove))
        self.publish([s for s, _ in parts], remove)

    def publish(self, staged: list[StagedPart], remove: list[str], *, durable: bool = False) -> None:
        """Step 3: removals, then rewrites of existing names, then new names (never a duplicate).

        Not fsynced unless `durable`: after a power cut a lost rename or unlink is redone by
        recovery, because the entry that asked for it is durable.
        """
        for name in remove:
            _unlink(self.out_dir / name)
        staged = sorted(staged, key=lambda s: not s.final_path.exists())
        publish_staged(staged, durable=durable)

    def recover(self) -> list[PartRecord]:
        """Finish what a crash interrupted; return committed parts that are missing or damaged.

        Deletes visible parts the manifest does not hold (a part removed by a commit the crash
        interrupted), publishes temps of committed parts, deletes every other temp.
        """
        state = self.state
        names = set(os.listdir(self.out_dir))
        for name in sorted(names):
            if PART_NAME_RE.fullmatch(name) and name not in state.parts:
                log.info("removing %s: no committed manifest entry holds it", name)
                _unlink(self.out_dir / name)
        by_temp = {r.temp: r for r in state.parts.values()}
        pending = []
        for name in sorted(names):
            record = by_temp.get(name)
            if record is None:
                continue
            if file_digest(self.out_dir / name) == (record.num_bytes, record.sha256):
                pending.append(StagedPart(self.out_dir / record.name, self.out_dir / name, record.num_rows,
                                          record.num_bytes, record.sha256))
            else:
                log.warning("staged file %s does not match its manifest entry; discarding it", name)
        if pending:
            log.info("publishing %d parts committed before the previous run stopped", len(pending))
            self.publish(pending, [])
        for directory in (self.out_dir, manifest_dir(self.out_dir)):
            for name in os.listdir(directory) if directory.is_dir() else []:
                if name.startswith(".") and name.endswith(TEMP_SUFFIX):  # uncommitted, or stale
                    _unlink(directory / name)
        damaged = []
        for record in state.parts.values():
            path = self.out_dir / record.name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                size = None
            if size != record.num_bytes:
                damaged.append(record)
        fsync_dir(self.out_dir)
        return damaged

    def drop_history(self) -> None:
        """Delete entries before the latest "begin" (dead since it); oldest first, so a crash
        part way leaves a contiguous suffix."""
        begin = self.state.begin_seq
        if begin is None:
            return
        directory = manifest_dir(self.out_dir)
        for seq, path in _entry_paths(directory):
            if seq >= begin:
                break
            _unlink(path)
        fsync_dir(directory)


def clear_success(out_dir: str | Path) -> None:
    path = Path(out_dir) / SUCCESS_FILE
    if path.exists():
        _unlink(path)
        fsync_dir(out_dir)


def write_success(out_dir: str | Path, payload: dict[str, Any]) -> None:
    write_json_atomic(Path(out_dir) / SUCCESS_FILE, payload)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        raise OutputError(f"cannot remove {path}: {e.strerror or e}") from e
