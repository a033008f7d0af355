"""The output directory's manifest: which parts are committed, and under which job config.

An output directory holds:

    part-NNNNN-xxxxxxxx.parquet  committed parts: all that pyarrow.dataset (or any reader) sees
    _manifest/NNNNNNNN.json      the commit log: one small JSON file per entry, never changed
    _batchgen.lock               the running job's lock (batchgen.io.store.lock)
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

In an object store (batchgen.io.store.store.ObjectStore: no rename, no fsync) step 1 writes each part
(one PUT, whole or absent) under its final, unique name; step 2 is the same entry (a new name,
written once); step 3 only deletes what the entry removes. A part is thus visible to a plain
listing before its entry exists: readers, `status` and `compact` go by the manifest, and recovery
deletes every part no entry names (a job killed between 1 and 2). A rewrite of a part gets a new
name and the entry removes the old one. The job's lease (batchgen.io.store.lease) is read back before
every entry (`guard`), so a job that lost it commits nothing more, and again between an entry (or a
listing) and the deletes it decides, so it deletes nothing the next holder commits (_check_guard).

Entry payloads (every entry also has "format", "seq", "time"):
    {"op": "begin", "fingerprint": {...}}   a job (re)starts here: earlier parts are all dropped
    {"op": "inputs", "inputs": [{"path", "num_rows", "identity"}], "max_rows", "orphans"}
                                            what the latest run reads (batchgen.jobs.durability.identity)
    {"op": "commit" | "compact" | "repair", "shards": [input paths], "write": [part], "remove": [names]}
    {"op": "snapshot", ...}                 the whole state so far (batchgen.io.manifest.snapshot)
    {"op": "fence"}                         nothing: chains past entries a superseded job wrote
On an object store every entry also has "epoch" (the lease's, batchgen.io.store.lease), and "prev" where
it was written past a superseded job's entry (Manifest._write_entry): readers follow "prev" (else
seq - 1) back from the newest entry and replay only that chain.
A part: {"name", "temp", "num_rows", "num_bytes", "sha256", "ids": [...], "errors": [positions of
         its error rows], "shard": [index into "shards", per row], "row": [input row index, per row],
         "hashes": [prompt hash per row, null for error rows]}.
"shard" and "row" are hidden bookkeeping for `batchgen compact` (input order) and `status`; "shards" and
"shard" name input files (their keys keep their first name: batchgen.io.manifest.part_record.FILES_KEY).
A part named again in "write" replaces the earlier version (a part minus its replaced rows).
Every entry is checked against the state before it is written (ManifestState.validate).

Loading replays the entries from the latest snapshot (batchgen.io.manifest.state): memory is
O(committed rows), about 60 bytes a row (each part's ids held compactly, batchgen.io.ids.compact_lists,
plus an exact hash index of them, batchgen.io.ids.index), and the time follows the parts, not the commits.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from batchgen.errors import AlreadyExists, OutputError, OutputLocked
from batchgen.io.manifest.part_record import FILES_KEY
from batchgen.io.manifest.snapshot import SNAPSHOT_EVERY_ENTRIES, snapshot_payload, stale_rows_files
from batchgen.io.manifest.state import (  # re-exported: the manifest's readers import them from here
    ENTRY_RE,
    FORMAT,
    MANIFEST_DIR,
    ManifestState,
    PartRecord,
    entry_epoch,
    entry_name,
    entry_paths,
    fingerprint_digest,
    is_job_dir,
    load_manifest,
    manifest_dir,
    part_rows,
    read_entry,
    read_entry_file,
)
from batchgen.io.manifest.success import (
    SUCCESS_FILE,
    check_parts_present,
    clear_success,
    describe_missing,
    missing_parts,
    write_success,
)
from batchgen.io.store.factory import open_store
from batchgen.io.store.local_files import TEMP_SUFFIX, fault_point
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.io.store.writers import StagedPart, json_bytes, publish_staged, write_json_atomic

__all__ = ["FORMAT", "MANIFEST_DIR", "PART_NAME_RE", "SUCCESS_FILE", "Manifest", "ManifestState", "PartRecord",
           "check_parts_present", "clear_success", "describe_missing", "fingerprint_digest", "is_job_dir",
           "load_manifest", "manifest_dir", "missing_parts", "part_rows", "read_entry", "write_success"]

log = logging.getLogger(__name__)

PART_NAME_RE = re.compile(r"part-\d{5,}-[0-9a-f]{8}\.parquet")


class Manifest:
    """Appends entries to one output directory's manifest; the caller holds the lock."""

    def __init__(self, out_dir: str | Path | OutputStore, state: ManifestState | None = None,
                 *, guard: Any = None):
        self.store = open_store(out_dir)
        # a local Path where there is one (callers build paths from it), else the store (its str is the URL)
        self.out_dir = self.store.path() if isinstance(self.store, LocalStore) else self.store
        self.state = state if state is not None else load_manifest(self.store)
        self.guard = guard  # the lock or lease: checked before each entry where it can be lost (a lease)
        self._entry_attempted = False  # the latest append got as far as writing its entry

    def append(self, op: str, **payload: Any) -> dict[str, Any]:
        """Write the next entry (the commit point) and apply it to the in-memory state."""
        store = self.store
        store.makedir(MANIFEST_DIR)
        base = {"format": FORMAT, "seq": self.state.last_seq + 1, "time": time.time(), "op": op, **payload}
        self.state.validate(base)  # before it is durable: a bad entry would fail every later load
        self._check_guard()
        self._entry_attempted = True
        entry = self._write_entry(lambda seq: {**base, "seq": seq})
        self.state.apply(entry)
        return entry

    def _write_entry(self, build: Any) -> dict[str, Any]:
        """Write `build(seq)` at the next free seq (put-if-absent) and return it.

        Under a lease (an object store) the entry carries the lease's epoch, and an entry found in
        the way whose epoch is lower was written by a job that lost the lease while stalled: it is
        written past, with "prev" naming the last entry this job's state holds, so readers (which
        follow "prev" back from the newest entry, batchgen.io.manifest.state) skip it. An entry of a
        higher epoch means this job is the superseded one: OutputLocked, nothing written."""
        epoch = getattr(self.guard, "epoch", None)
        prev = self.state.last_seq
        seq = prev + 1
        while True:
            entry = build(seq)
            if epoch is not None:
                entry["epoch"] = epoch
                if seq != prev + 1:
                    entry["prev"] = prev
            try:
                write_json_atomic(self._entry_target(seq), entry, exclusive=True)
                return entry
            except AlreadyExists:
                if epoch is None:
                    raise
                other = read_entry_file(self.store, entry_name(seq))
            if other == json.loads(json_bytes(entry)):  # our own PUT landed, then its response was lost
                return entry
            if entry_epoch(other) >= epoch:
                self._entry_attempted = False  # certainly not written: the caller may discard its parts
                raise OutputLocked(f"another job committed to {self.store} after this one lost its lease (manifest "
                                   f"entry {seq}); this job stopped without committing more")
            log.warning("writing past manifest entry %d of %s: a job that lost the lease wrote it (epoch %d < %d)",
                        seq, self.store, entry_epoch(other), epoch)
            seq += 1

    def fence_stale_entries(self) -> None:
        """Entries past this job's own (a stalled job's, written after it lost the lease) would be
        read as the newest: chain a "fence" entry past them, so every reader skips them."""
        names = self.store.list(MANIFEST_DIR)
        if any(int(m.group(1)) > self.state.last_seq for name in names if (m := ENTRY_RE.fullmatch(name))):
            self.append("fence")

    def _entry_target(self, seq: int) -> Path | tuple[OutputStore, str]:
        if isinstance(self.store, LocalStore):
            return self.store.path(entry_name(seq))
        return self.store, entry_name(seq)

    def _check_guard(self) -> None:
        """A lease can expire under a stalled job and be taken over: never commit after that.

        Also between what a job decides to delete and the deletes (a part an entry removes, an
        orphan part, the entries before a snapshot): an object store has no conditional delete,
        and a job that lost the lease while paused could delete what the new holder commits. A
        check passed after the entry (or the listing) proves no other job took the output over
        before it: a later holder loads the manifest after that, and its state already holds the
        entry (commits nothing the deletes remove), so deletes that a pause delays past the
        check still remove only what no holder counts."""
        check = getattr(self.guard, "check", None)
        if check is not None:
            check()

    def begin(self, fingerprint: dict[str, Any]) -> None:
        """Start a job: from this entry on, no earlier part counts (and recovery deletes them)."""
        self.append("begin", fingerprint=fingerprint)

    def commit(self, parts: list[tuple[StagedPart, PartRecord]], remove: list[str] = (), *,
               op: str = "commit") -> None:
        """Commit staged parts (new ones and rewrites) and removals, then publish them."""
        if not parts and not remove:
            return
        try:
            self._check_guard()  # a job that lost the lease must not remove the new holder's _SUCCESS either
        except BaseException:
            for staged, _ in parts:
                staged.discard()
            raise
        clear_success(self.store)  # the visible output is about to change
        try:
            fault_point("fsync_staged")
            self.store.sync()  # the staged temps' names: an entry must never outlive its files
        except OSError as e:
            raise OutputError(f"cannot sync {self.out_dir}: {e.strerror or e}") from e
        file_paths = sorted({f for _, r in parts for f in r.files})
        index = {path: i for i, path in enumerate(file_paths)}
        self._entry_attempted = False
        try:
            self.append(op, **{FILES_KEY: file_paths}, write=[r.to_json(index) for _, r in parts], remove=list(remove))
        except BaseException:
            # refused before its entry was written (the lease lost, another writer's entry in the way):
            # nothing commits these parts, and in an object store they sit under final names where a
            # plain listing reads them. An entry whose write failed part way may have landed: keep
            # its parts; the sweep before _SUCCESS (sweep) or the next run's recovery decides.
            if not self._entry_attempted:
                for staged, _ in parts:
                    staged.discard()
            raise
        if remove:
            self._check_guard()  # the entry is visible to every later holder before anything goes (_check_guard)
        self.publish([s for s, _ in parts], remove)
        if op == "commit" and self.state.last_seq - (self.state.snapshot_seq or 0) >= SNAPSHOT_EVERY_ENTRIES:
            self.snapshot()

    def snapshot(self) -> None:
        """Consolidate: one entry (and its rows file) holding the whole state, then drop the
        entries before it (batchgen.io.manifest.snapshot), so a load stays O(parts)."""
        state = self.state
        self._check_guard()
        entry = self._write_entry(lambda seq: {"format": FORMAT, "seq": seq, "time": time.time(), "op": "snapshot",
                                                **snapshot_payload(self.store, state, seq)})
        seq = entry["seq"]
        # the in-memory state already is the snapshot's; only where each part's rows live moved
        for record in state.parts.values():
            record.seq = seq
        state.last_seq = state.snapshot_seq = seq
        state.snapshot_rows = entry["rows"]["name"]
        self.drop_before(seq)

    def publish(self, staged: list[StagedPart], remove: list[str], *, durable: bool = False) -> None:
        """Step 3: removals, then rewrites of existing names, then new names (never a duplicate).

        Not fsynced unless `durable`: after a power cut a lost rename or unlink is redone by
        recovery, because the entry that asked for it is durable. In an object store the parts
        are in place already (staged under their final names): only the removals remain.
        """
        for name in remove:
            self.store.delete(name)
        if staged and self.store.renames:
            present = self.store.list()
            staged = sorted(staged, key=lambda s: s.name not in present)
        publish_staged(staged, durable=durable)

    def recover(self) -> list[PartRecord]:
        """Finish what a crash interrupted; return committed parts that are missing or damaged.

        Deletes visible parts the manifest does not hold (a part removed by a commit the crash
        interrupted, or, in an object store, a part staged under its final name that no entry
        committed), publishes temps of committed parts, deletes every other temp.
        """
        state, store = self.state, self.store
        names = store.list()
        orphans = [name for name in sorted(names) if PART_NAME_RE.fullmatch(name) and name not in state.parts]
        if orphans:
            self._check_guard()
        for name in orphans:
            log.info("removing %s: no committed manifest entry holds it", name)
            store.delete(name)
        by_temp = {r.temp: r for r in state.parts.values() if r.temp != r.name}  # an object store's: none
        pending = []
        for name in sorted(names):
            record = by_temp.get(name)
            if record is None:
                continue
            if store.digest(name) == (record.num_bytes, record.sha256):
                pending.append(StagedPart(store, record.name, name, record.num_rows, record.num_bytes, record.sha256))
            else:
                log.warning("staged file %s does not match its manifest entry; discarding it", name)
        if pending:
            log.info("publishing %d parts committed before the previous run stopped", len(pending))
            self.publish(pending, [])
        for sub in ("", MANIFEST_DIR):
            for name in store.list(sub):
                if name.startswith(".") and name.endswith(TEMP_SUFFIX):  # uncommitted, or stale
                    store.delete(f"{sub}/{name}" if sub else name)
        damaged = missing_parts(store, state)
        store.sync()
        return damaged

    def sweep(self) -> list[str]:
        """Delete every part file, visible or staged, that no committed entry holds; return their names.

        Run before `_SUCCESS` is written: it vouches for a plain listing (`**/*.parquet`), which
        must then hold exactly the committed parts. A commit that failed (this job's, or a stalled
        job's that lost the lease) can leave a part under its final name in an object store, or a
        staged temp in a directory; either would be read beside the committed rows."""
        self.fence_stale_entries()
        state, store = self.state, self.store
        swept = [name for name in sorted(store.list()) if (PART_NAME_RE.fullmatch(name) and name not in state.parts)
                 or (name.startswith(".part-") and name.endswith(TEMP_SUFFIX))]
        if swept:
            self._check_guard()
        for name in swept:
            log.info("removing %s: no committed manifest entry holds it", name)
            store.delete(name)
        if swept:
            store.sync()
        return swept

    def drop_history(self) -> None:
        """Delete entries before the latest "begin" or snapshot (dead since it)."""
        first = max(self.state.begin_seq or 0, self.state.snapshot_seq or 0)
        if first:
            self.drop_before(first)

    def drop_before(self, first: int) -> None:
        """Delete entries before seq `first`, oldest first, so a crash part way leaves a contiguous
        suffix; and every snapshot rows file but the current one."""
        store = self.store
        names = [name for seq, name in entry_paths(store) if seq < first]  # oldest first
        names += stale_rows_files(store, self.state.snapshot_rows)
        if names:
            self._check_guard()
        for name in names:
            store.delete(name)
        store.sync(MANIFEST_DIR)

