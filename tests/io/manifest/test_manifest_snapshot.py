"""Manifest snapshots: a long job's manifest stays O(parts) to load.

Every SNAPSHOT_EVERY_ENTRIES entries the whole state is written as one entry plus a rows file and
the older entries are deleted; a reload gives the same state (ids, error rows, prompt hashes, the
input rows of each part), status reads counts without the rows file, and a crash half way through
a snapshot loses nothing.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet  # noqa: F401  (pa.parquet)
import pytest

from batchgen.errors import DamagedSnapshot
from batchgen.io.manifest import manifest as manifest_module
from batchgen.io.manifest import snapshot as manifest_snapshot
from batchgen.io.manifest.manifest import MANIFEST_DIR, Manifest, PartRecord, load_manifest, part_rows
from batchgen.io.store.schema import output_schema
from batchgen.io.store.store import LocalStore
from batchgen.io.store.writers import PartWriter

SCHEMA = output_schema(pa.field("id", pa.int64()), [])
EVERY = 5


class Crash(BaseException):
    pass


def rows(ids, error_ids):
    return [{"id": i, "generated_text": None if i in error_ids else f"t{i}",
             "finish_reason": "error" if i in error_ids else "stop", "num_prompt_tokens": 1,
             "num_generated_tokens": 1, "error": "bad" if i in error_ids else None,
             "prompt_hash": None if i in error_ids else f"{i:016x}"} for i in ids]


def commit(manifest, writer, ids, error_ids=()):
    part = writer.stage_part(rows(ids, error_ids), tag=f".{manifest.state.last_seq + 1:08d}")
    file = f"/data/shard-{ids[0] % 3}.parquet"
    record = PartRecord.staged(part, list(ids), [i in error_ids for i in ids], [file] * len(ids),
                               [i * 10 for i in ids], [None if i in error_ids else f"{i:016x}" for i in ids])
    manifest.commit([(part, record)])


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_module, "SNAPSHOT_EVERY_ENTRIES", EVERY)
    path = tmp_path / "out"
    path.mkdir()
    Manifest(path).begin({"model": "m"})
    return path


def entries(out):
    return sorted(p.name for p in (out / MANIFEST_DIR).iterdir())


def test_a_long_job_keeps_a_bounded_manifest_and_reloads_the_same_state(out):
    manifest = Manifest(out, load_manifest(out, keep_hashes=True))
    manifest.state.keep_hashes = True
    writer = PartWriter(out, SCHEMA)
    for n in range(40):
        commit(manifest, writer, [2 * n, 2 * n + 1], error_ids={2 * n + 1} if n % 7 == 0 else set())
        assert len([e for e in entries(out) if e.endswith(".json")]) <= EVERY + 1
        assert len([e for e in entries(out) if e.endswith(".rows.parquet")]) <= 1
    live = manifest.state
    live.check_integrity()
    state = load_manifest(out, keep_hashes=True)
    state.check_integrity()
    assert (state.ok_ids, state.error_ids, state.prompt_hashes) == (live.ok_ids, live.error_ids, live.prompt_hashes)
    assert state.prompt_hashes[4] == f"{4:016x}" and len(state.parts) == 40
    assert {n: r.file_counts for n, r in state.parts.items()} == {n: r.file_counts for n, r in live.parts.items()}
    first = next(iter(state.parts.values()))  # carried by the snapshot: its rows come from the rows file
    assert part_rows(out, first) == (["/data/shard-0.parquet"] * 2, [0, 10])
    kept = load_manifest(out, keep_rows=True)
    assert kept.parts[first.name].rows == [0, 10]
    # status reads counts only: the rows file is not needed
    light = load_manifest(out, with_ids=False)
    assert {n: r.file_counts for n, r in light.parts.items()} == {n: r.file_counts for n, r in live.parts.items()}
    rows_file = next((out / MANIFEST_DIR).glob("*.rows.parquet"))
    rows_file.rename(rows_file.with_suffix(".moved"))
    load_manifest(out, with_ids=False)
    with pytest.raises(Exception, match="unreadable"):
        load_manifest(out)


def test_a_crash_during_a_snapshot_loses_nothing(out, monkeypatch):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    for n in range(EVERY - 2):
        commit(manifest, writer, [n])

    real = manifest_module.write_json_atomic

    def die_at_the_snapshot(path, entry, **kwargs):
        if entry["op"] == "snapshot":
            raise Crash
        real(path, entry, **kwargs)

    # the commit's entry and the rows file are written, then the process dies before the snapshot entry
    monkeypatch.setattr(manifest_module, "write_json_atomic", die_at_the_snapshot)
    with pytest.raises(Crash):
        commit(manifest, writer, [100])
    monkeypatch.undo()
    assert list((out / MANIFEST_DIR).glob("*.rows.parquet"))  # written, never committed
    from batchgen.jobs.durability.session import OutputSession

    session = OutputSession(out)
    session.open()
    try:
        assert session.state.ok_ids == {*range(EVERY - 2), 100}
        assert not list((out / MANIFEST_DIR).glob("*.rows.parquet"))
    finally:
        session.close()


def test_a_crash_while_old_entries_are_deleted_leaves_a_loadable_suffix(out, monkeypatch):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    calls = []
    real = LocalStore.delete

    def unlink_then_die(self, name):
        calls.append(name)
        real(self, name)
        if len(calls) == 2:
            raise Crash

    monkeypatch.setattr(LocalStore, "delete", unlink_then_die)
    with pytest.raises(Crash):
        for n in range(EVERY + 1):
            commit(manifest, writer, [n])
    monkeypatch.undo()
    state = load_manifest(out)
    state.check_integrity()
    assert state.ok_ids == set(range(EVERY - 1))
    snapshot = json.loads((out / MANIFEST_DIR / f"{EVERY + 1:08d}.json").read_text())
    assert snapshot["op"] == "snapshot" and snapshot["rows"]["num_rows"] == EVERY - 1


def test_snapshot_every_is_what_the_writer_uses():
    assert manifest_snapshot.SNAPSHOT_EVERY_ENTRIES == manifest_module.SNAPSHOT_EVERY_ENTRIES


def test_a_snapshot_after_removed_and_rewritten_parts_carries_every_row_over(out):
    """The next snapshot streams the previous one's rows file (not loaded whole); parts removed or
    rewritten since leave gaps in it that must be skipped, not mistaken for the next part's rows."""
    manifest = Manifest(out, load_manifest(out, keep_hashes=True))
    manifest.state.keep_hashes = True
    writer = PartWriter(out, SCHEMA)
    for n in range(EVERY):  # the first snapshot carries these parts
        commit(manifest, writer, [3 * n, 3 * n + 1, 3 * n + 2])
    assert manifest.state.snapshot_seq is not None
    names = list(manifest.state.parts)
    manifest.commit([], remove=[names[1]])  # a gap in the middle of the rows file
    part = writer.stage_part(rows([6, 7], ()), tag=".rewrite")  # names[2] rewritten without one row
    record = PartRecord.staged(part, [6, 7], [False, False], ["/data/x.parquet"] * 2, [60, 70],
                               [f"{6:016x}", f"{7:016x}"])
    record.name = names[2]
    manifest.commit([(part, record)])
    for n in range(EVERY, 2 * EVERY + 1):  # enough commits for a second snapshot
        commit(manifest, writer, [3 * n, 3 * n + 1, 3 * n + 2])
    live = manifest.state
    state = load_manifest(out, keep_rows=True, keep_hashes=True)
    state.check_integrity()
    assert (state.ok_ids, state.prompt_hashes) == (live.ok_ids, live.prompt_hashes)
    assert {3, 4, 5, 8} - set(state.ok_ids) == {3, 4, 5, 8}
    for name, kept in state.parts.items():
        first = kept.ids[0]
        expected = [60, 70] if name == names[2] else [i * 10 for i in kept.ids]
        assert kept.rows == expected, (name, first)


def test_counts_only_loads_count_every_committed_row_after_a_snapshot(out):
    """A counts-only load (status, finalize) held the snapshot's parts without ids, and
    num_committed_rows counted ids: it gave only the rows committed after the snapshot (a 1M-row
    job showed 42,000), and a later entry rewriting a snapshot-carried part could not be replayed."""
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    for n in range(2 * EVERY + 2):  # at least one snapshot, then entries after it
        commit(manifest, writer, [2 * n, 2 * n + 1], error_ids={2 * n + 1} if n == 0 else set())
    full, light = load_manifest(out), load_manifest(out, with_ids=False)
    assert light.snapshot_seq is not None
    assert full.num_committed_rows == light.num_committed_rows == 2 * (2 * EVERY + 2)
    # the first part (a snapshot's, holding an error row) rewritten by a later entry, as a retry does
    first = next(iter(full.parts.values()))
    part = writer.stage_part(rows([0], ()), tag=f".{manifest.state.last_seq + 1:08d}")
    record = PartRecord.staged(part, [0], [False], ["/data/shard-0.parquet"], [0], [f"{0:016x}"])
    manifest.commit([(part, record)], [first.name])
    full, light = load_manifest(out), load_manifest(out, with_ids=False)
    full.check_integrity()
    assert full.num_committed_rows == light.num_committed_rows == 2 * (2 * EVERY + 2) - 1
    assert {n: r.file_counts for n, r in light.parts.items()} == {n: r.file_counts for n, r in full.parts.items()}


def rows_file(out):
    (path,) = (out / MANIFEST_DIR).glob("*.rows.parquet")
    return path


def test_a_rows_file_other_than_the_recorded_one_is_refused(out):
    """The rows file's sha256 was recorded but never checked: a rows file replaced by another
    valid one (here: an id changed) handed the load other committed ids."""
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)
    for n in range(EVERY):
        commit(manifest, writer, [n])
    path = rows_file(out)
    table = pa.parquet.read_table(path)
    ids = table.column("id").to_pylist()
    table = table.set_column(table.schema.get_field_index("id"), "id", pa.array([ids[0] + 1000, *ids[1:]]))
    pa.parquet.write_table(table, path)
    with pytest.raises(DamagedSnapshot, match="not the file the snapshot recorded") as e:
        load_manifest(out)
    assert e.value.exit_code == 2 and "--overwrite" in str(e.value)
    assert load_manifest(out, with_ids=False).num_committed_rows == EVERY  # status reads counts only


def test_a_damaged_snapshot_falls_back_to_the_entries_a_crash_kept(out, monkeypatch):
    manifest = Manifest(out)
    writer = PartWriter(out, SCHEMA)

    def die_before_deleting(self, name):
        raise Crash

    monkeypatch.setattr(LocalStore, "delete", die_before_deleting)
    with pytest.raises(Crash):  # the snapshot is committed; the entries before it are all still there
        for n in range(EVERY + 1):
            commit(manifest, writer, [n])
    monkeypatch.undo()
    rows_file(out).write_bytes(b"damaged")
    state = load_manifest(out)
    state.check_integrity()
    assert state.ok_ids == set(range(EVERY - 1)) and state.last_seq == EVERY + 1
    manifest = Manifest(out, state)
    commit(manifest, PartWriter(out, SCHEMA), [100])  # the job goes on after the damaged snapshot
    assert load_manifest(out).ok_ids == {*range(EVERY - 1), 100}
