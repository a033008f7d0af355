"""batchgen.io.manifest.manifest: the commit log, and recovery from every state a crash can leave.

A crash is simulated by an exception that no cleanup code catches as an OSError (`Crash`, raised
from the writers' fault hook), or by skipping the publish step, then a fresh Manifest recovers.
"""

from __future__ import annotations

import errno
import json
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import (
    MANIFEST_DIR,
    SUCCESS_FILE,
    Manifest,
    PartRecord,
    load_manifest,
    part_rows,
    write_success,
)
from batchgen.io.store import local_files
from batchgen.io.store.schema import output_schema
from batchgen.io.store.writers import PartWriter

SCHEMA = output_schema(pa.field("id", pa.int64()), [])
FILE = "/data/in.parquet"


class Crash(BaseException):
    """Stands for the process dying at a fault-hook stage."""


def rows(ids, *, error_ids=()):
    return [{"id": i, "generated_text": None if i in error_ids else f"text {i}",
             "finish_reason": "error" if i in error_ids else "stop", "num_prompt_tokens": 3,
             "num_generated_tokens": 0 if i in error_ids else 2, "error": "bad row" if i in error_ids else None}
            for i in ids]


def stage(writer, ids, *, error_ids=(), tag=".00000001", name=None):
    part = writer.stage_part(rows(ids, error_ids=error_ids), tag=tag, name=name)
    return part, PartRecord.staged(part, list(ids), [i in error_ids for i in ids], [FILE] * len(ids),
                                   list(ids))


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    manifest = Manifest(path)
    manifest.begin({"model": "m", "max_new_tokens": 4})
    return path


def visible_ids(out):
    table = ds.dataset(str(out), format="parquet").to_table() if list(out.glob("part-*")) else None
    return sorted(table.column("id").to_pylist()) if table is not None else []


def fresh(out) -> Manifest:
    manifest = Manifest(out)
    manifest.recover()
    manifest.state.check_integrity()
    return manifest


def test_commit_publishes_and_a_reload_sees_the_same(out):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0, 1, 2], error_ids={1})])
    manifest.commit([stage(writer, [3, 4], tag=".00000002")])
    assert visible_ids(out) == [0, 1, 2, 3, 4]
    assert not list(out.glob(".*"))
    state = load_manifest(out)
    state.check_integrity()
    assert state.ok_ids == {0, 2, 3, 4} and set(state.error_ids) == {1}
    assert state.num_committed_rows == 5 and len(state.parts) == 2
    entries = sorted(p.name for p in (out / MANIFEST_DIR).iterdir())
    assert entries == ["00000001.json", "00000002.json", "00000003.json"]
    first = json.loads((out / MANIFEST_DIR / "00000002.json").read_text())
    (part,) = first["write"]
    assert part["ids"] == [0, 1, 2] and part["errors"] == [1] and part["num_rows"] == 3
    # the input file keys are the ones every version wrote (part_record.FILES_KEY): older readers read them
    assert part["shard"] == [0, 0, 0] and first["shards"] == [FILE] and part["row"] == [0, 1, 2]
    assert len(part["sha256"]) == 64 and part["num_bytes"] == (out / part["name"]).stat().st_size
    record = state.parts[part["name"]]
    assert record.file_counts == {FILE: [2, 1]}
    assert part_rows(out, record) == ([FILE] * 3, [0, 1, 2])  # read back from the entry


@pytest.mark.parametrize("stage_name", ["fsync_staged", "file_write", "file_fsync", "file_rename"])
def test_crash_before_the_entry_loses_nothing_committed_and_shows_nothing(out, monkeypatch, stage_name):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0, 1])])
    staged = stage(writer, [2, 3], tag=".00000003")  # staged, then the process dies

    def die(current):
        if current == stage_name:
            raise Crash

    monkeypatch.setattr(local_files, "_fault_hook", die)
    with pytest.raises(Crash):
        manifest.commit([staged])
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert staged[0].temp_path.exists()  # hidden, so no reader sees it
    assert visible_ids(out) == [0, 1]
    manifest = fresh(out)
    assert manifest.state.ok_ids == {0, 1}
    assert not list(out.glob(".*")) and not list((out / MANIFEST_DIR).glob(".*"))


@pytest.mark.parametrize("stage_name", ["file_fsync_dir", "publish", "rename"])
def test_crash_after_the_entry_is_rolled_forward(out, monkeypatch, stage_name):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0, 1])])
    if stage_name == "publish":
        monkeypatch.setattr(Manifest, "publish", lambda self, staged, remove: None)
    else:
        def die(current):
            if current == stage_name:
                raise Crash

        monkeypatch.setattr(local_files, "_fault_hook", die)
    try:
        manifest.commit([stage(writer, [2, 3], tag=".00000003"), stage(writer, [4], tag=".00000003")])
    except Crash:
        pass
    monkeypatch.undo()
    assert visible_ids(out) in ([0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4])  # never more than committed
    fresh(out)
    assert visible_ids(out) == [0, 1, 2, 3, 4]
    assert not list(out.glob(".*"))


def test_rewrite_replaces_rows_and_a_crash_never_shows_an_id_twice(out, monkeypatch):
    """A retried error row: its part is rewritten without it and the new row lands in a new part."""
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0, 1, 2], error_ids={1, 2})])
    old_name = next(iter(manifest.state.parts))
    rewritten = stage(writer, [0, 2], error_ids={2}, name=old_name, tag=".00000003")
    new = stage(writer, [1], tag=".00000003")
    seen = []

    def watch(current):
        if current == "rename":
            seen.append(visible_ids(out))
            if len(seen) == 2:
                raise Crash  # between the rewrite and the new part

    monkeypatch.setattr(local_files, "_fault_hook", watch)
    with pytest.raises(Crash):
        manifest.commit([new, rewritten])  # publish orders the rewrite first whatever the order here
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert seen == [[0, 1, 2], [0, 2]]  # id 1 is briefly missing, never doubled
    manifest = fresh(out)
    table = ds.dataset(str(out), format="parquet").to_table()
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert sorted(table.column("id").to_pylist()) == [0, 1, 2]
    assert by_id[1]["error"] is None and by_id[2]["error"] == "bad row"
    assert manifest.state.ok_ids == {0, 1} and manifest.state.error_ids == {2: old_name}


def test_removed_part_left_visible_by_a_crash_is_deleted(out, monkeypatch):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0])])
    name = next(iter(manifest.state.parts))
    monkeypatch.setattr(Manifest, "publish", lambda self, staged, remove: None)
    manifest.commit([], [name], op="repair")
    monkeypatch.undo()
    assert (out / name).exists()
    fresh(out)
    assert not (out / name).exists() and visible_ids(out) == []


def test_orphan_visible_part_and_stray_temps_are_removed(write_part, out):
    writer = PartWriter(out, SCHEMA)
    orphan = write_part(writer, rows([9]))  # visible, but no entry lists it
    (out / ".part-00007-0badc0de.parquet.00000009.tmp").write_bytes(b"half")
    (out / MANIFEST_DIR / ".00000002.json.12345678.tmp").write_bytes(b"{")
    (out / "._SUCCESS.abcdef01.tmp").write_bytes(b"")
    fresh(out)
    assert not orphan.exists() and not list(out.glob(".*"))
    assert not list((out / MANIFEST_DIR).glob(".*"))


def test_a_committed_temp_that_does_not_match_its_entry_is_not_published(out, monkeypatch):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    monkeypatch.setattr(Manifest, "publish", lambda self, staged, remove: None)
    part, record = stage(writer, [0, 1])
    manifest.commit([(part, record)])
    monkeypatch.undo()
    part.temp_path.write_bytes(b"PAR1 torn")
    damaged = Manifest(out).recover()
    assert [r.name for r in damaged] == [record.name]
    assert not part.temp_path.exists() and not part.final_path.exists()


def test_missing_part_is_reported_for_repair(out):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0, 1])])
    (name,) = manifest.state.parts
    (out / name).unlink()
    manifest = Manifest(out)
    damaged = manifest.recover()
    assert [r.name for r in damaged] == [name]
    manifest.commit([], [name], op="repair")
    assert load_manifest(out).num_committed_rows == 0


def test_disk_full_while_writing_the_entry_commits_nothing(out, monkeypatch):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    staged = stage(writer, [0])

    def full(current):
        if current == "file_write":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local_files, "_fault_hook", full)
    with pytest.raises(OutputError, match="No space left on device"):
        manifest.commit([staged])
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert load_manifest(out).num_committed_rows == 0
    fresh(out)
    assert visible_ids(out) == [] and not list(out.glob(".*"))


def test_success_marker_is_cleared_by_the_next_commit(out):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    write_success(out, {"rows": 0})
    assert (out / SUCCESS_FILE).exists()
    manifest.commit([stage(writer, [0])])
    assert not (out / SUCCESS_FILE).exists()


def test_begin_drops_earlier_parts_and_history(out):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0, 1])])
    manifest.begin({"model": "other"})
    assert manifest.state.num_committed_rows == 0 and manifest.state.fingerprint == {"model": "other"}
    manifest.recover()
    manifest.drop_history()
    assert visible_ids(out) == []
    assert sorted(p.name for p in (out / MANIFEST_DIR).iterdir()) == ["00000003.json"]
    state = load_manifest(out)
    assert state.fingerprint == {"model": "other"} and state.last_seq == 3


def test_an_id_committed_twice_never_reaches_the_manifest(out):
    """The entry is validated before it is written, so a duplicate id that
    reaches a commit leaves no durable bad entry and every later load still works."""
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    manifest.commit([stage(writer, [0, 1])])
    entries = sorted(p.name for p in (out / MANIFEST_DIR).iterdir())
    with pytest.raises(AssertionError, match="committed twice"):
        manifest.commit([stage(writer, [1], tag=".00000003")])
    with pytest.raises(AssertionError, match="committed twice"):
        manifest.commit([stage(writer, [5, 5], tag=".00000003")])
    assert sorted(p.name for p in (out / MANIFEST_DIR).iterdir()) == entries
    state = load_manifest(out)
    state.check_integrity()
    assert state.ok_ids == {0, 1}
    # a damaged directory (an entry written by something else) is still reported as damage on load
    bad = json.loads((out / MANIFEST_DIR / "00000002.json").read_text())
    bad["seq"] = 3
    bad["write"][0]["name"] = "part-00009-0000abcd.parquet"
    (out / MANIFEST_DIR / "00000003.json").write_text(json.dumps(bad))
    with pytest.raises(OutputError, match="committed twice"):
        load_manifest(out)


def test_unreadable_entry_and_gap_are_reported(out):
    manifest = Manifest(out)
    manifest.append("inputs", inputs=[], max_rows=None)
    (out / MANIFEST_DIR / "00000002.json").write_text("{not json")
    with pytest.raises(OutputError, match="00000002.json is unreadable"):
        load_manifest(out)
    (out / MANIFEST_DIR / "00000002.json").unlink()
    # read back from the newest entry along its chain: the first missing link is reported
    (out / MANIFEST_DIR / "00000004.json").write_text(json.dumps({"format": 1, "seq": 4, "time": 0, "op": "inputs",
                                                                  "inputs": [], "max_rows": None}))
    with pytest.raises(OutputError, match="entry 00000003.json is missing"):
        load_manifest(out)


def test_an_existing_entry_is_never_overwritten(out):
    manifest = Manifest(out)
    (out / MANIFEST_DIR / "00000002.json").write_text("{}")  # as if another process got past the lock
    with pytest.raises(OutputError, match="another process"):
        manifest.append("inputs", inputs=[], max_rows=None)
    assert (out / MANIFEST_DIR / "00000002.json").read_text() == "{}"


def test_parts_stay_readable_and_match_their_checksums(out):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    for seq in range(2, 6):
        manifest.commit([stage(writer, range(seq * 10, seq * 10 + 3), tag=f".{seq:08d}")])
    for record in load_manifest(out).parts.values():
        assert local_files.file_digest(out / record.name) == (record.num_bytes, record.sha256)
        assert pq.read_table(out / record.name).column("id").to_pylist() == record.ids
