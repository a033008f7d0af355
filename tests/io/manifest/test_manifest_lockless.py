"""A lockless reader (`batchgen status`) during a healthy job: a consolidation that deletes old
entries between the reader's listing and its reads is no damage; it lists again."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from batchgen.errors import OutputError
from batchgen.io.manifest import snapshot as manifest_snapshot
from batchgen.io.manifest.entries import entry_name
from batchgen.io.manifest.manifest import Manifest, PartRecord, load_manifest
from batchgen.io.store.store import LocalStore
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands.status import job_status

SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string())])


def commit_rows(manifest: Manifest, writer: PartWriter, ids: list[int]) -> None:
    part = writer.stage_part([{"id": i, "error": None} for i in ids])
    manifest.commit([(part, PartRecord.staged(part, ids, [False] * len(ids), ["in.parquet"] * len(ids), ids))])


class ConsolidatedMidRead(LocalStore):
    """The job's snapshot drops the old entries just after this reader listed them."""

    def __init__(self, root, manifest: Manifest):
        super().__init__(root)
        self.manifest = manifest
        self.dropped = False

    def read_bytes(self, name: str) -> bytes:
        if not self.dropped and name == entry_name(1):
            self.dropped = True
            self.manifest.snapshot()  # writes entry N+1 and deletes 1..N
        return super().read_bytes(name)


def test_status_lists_again_when_a_snapshot_drops_entries_under_it(tmp_path):
    store = LocalStore(tmp_path)
    manifest = Manifest(store)
    manifest.begin({"k": 1})
    writer = PartWriter(store, SCHEMA)
    for start in range(0, 12, 3):
        commit_rows(manifest, writer, list(range(start, start + 3)))
    status = job_status(ConsolidatedMidRead(tmp_path, manifest))  # before: "damaged: pass --overwrite"
    assert status["num_parts"] == 4 and status["num_entries"] == 6


def test_a_missing_entry_is_still_damage_once_it_stays_missing(tmp_path, monkeypatch):
    from batchgen.io.manifest import state as manifest_state

    monkeypatch.setattr(manifest_state, "VANISHED_PAUSE_S", 0.001)
    store = LocalStore(tmp_path)
    manifest = Manifest(store)
    manifest.begin({"k": 1})
    commit_rows(manifest, PartWriter(store, SCHEMA), [1])
    commit_rows(manifest, PartWriter(store, SCHEMA), [2])
    store.delete(entry_name(2))
    with pytest.raises(OutputError, match="damaged"):
        load_manifest(store)


def test_polling_status_through_many_snapshots_never_sees_damage(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_snapshot, "SNAPSHOT_EVERY_ENTRIES", 3)
    from batchgen.io.manifest import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "SNAPSHOT_EVERY_ENTRIES", 3)
    store = LocalStore(tmp_path)
    manifest = Manifest(store)
    manifest.begin({"k": 1})
    writer = PartWriter(store, SCHEMA)
    done = threading.Event()
    errors: list[Exception] = []

    def poll() -> None:
        while not done.is_set():
            try:
                job_status(tmp_path)
            except OutputError as e:
                errors.append(e)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for i in range(60):
            commit_rows(manifest, writer, [i])
    finally:
        done.set()
        poller.join()
    assert not errors, errors[:1]
    assert load_manifest(tmp_path).num_committed_rows == 60
