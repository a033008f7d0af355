"""batchgen.io.store.store and batchgen.io.store.lease against a real S3 API server on localhost (moto).

The commit protocol without rename: parts are written under their final, unique names before the
manifest entry that commits them; recovery deletes the parts no entry names; the lease keeps a
second job out until it expires (or its holder is known dead on this host).
"""

from __future__ import annotations

import json
import logging
import time

import pyarrow as pa
import pytest

from batchgen.errors import OutputLocked, UnsupportedOutputError
from batchgen.io.manifest.manifest import Manifest, PartRecord, load_manifest
from batchgen.io.store.factory import check_output_url, open_store
from batchgen.io.store.lease import LEASE_FILE, Lease, lease_holder, read_lease
from batchgen.io.store.object_store import ObjectStore
from batchgen.io.store.store import LocalStore
from batchgen.io.store.writers import PartWriter

pytestmark = [pytest.mark.soak, pytest.mark.usefixtures("quick_lease_settle")]

SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string())])


def stage(writer: PartWriter, ids: list[int]):
    part = writer.stage_part([{"id": i, "error": None} for i in ids])
    return part, PartRecord.staged(part, ids, [False] * len(ids), ["in.parquet"] * len(ids), ids)


@pytest.mark.parametrize("url", ["ftp://host/out", "hdfs://nn/out", "s3://bucket-only", "s3://bucket/"])
def test_unsupported_output_urls_are_refused(url):
    with pytest.raises(UnsupportedOutputError):
        check_output_url(url)


def test_open_store_picks_the_implementation(tmp_path, s3_out):
    assert isinstance(open_store(tmp_path), LocalStore)
    store = open_store(s3_out)
    assert isinstance(store, ObjectStore) and not store.renames and str(store) == s3_out


def test_store_operations(s3_out):
    store = open_store(s3_out)
    assert store.list() == {} and not store.exists("a.json")
    store.write_bytes("a.json", b"{}")
    store.write_bytes("_manifest/00000001.json", b"[1]")
    assert store.list() == {"a.json": 2, "_manifest": None}
    assert store.is_dir("_manifest") and not store.is_dir("nothing")
    assert store.read_bytes("_manifest/00000001.json") == b"[1]"
    with pytest.raises(FileNotFoundError):
        store.read_bytes("missing.json")
    with pytest.raises(Exception, match="appeared"):
        store.write_bytes("a.json", b"x", exclusive=True)
    store.delete("a.json")
    store.delete("a.json")  # absent: nothing to do
    assert not store.exists("a.json")


def test_commit_protocol_without_rename(s3_out):
    store = open_store(s3_out)
    writer = PartWriter(store, SCHEMA)
    manifest = Manifest(store)
    manifest.begin({"k": 1})
    part, record = stage(writer, [1, 2])
    assert part.name == part.temp  # written under its final name: no rename in an object store
    assert store.exists(part.name)
    manifest.commit([(part, record)])
    uncommitted, _ = stage(writer, [3])  # a crash now: a part no entry names
    state = load_manifest(store)
    assert sorted(state.parts) == [part.name] and state.ok_ids == {1, 2}
    Manifest(store, state).recover()  # the next run: the unnamed part goes
    assert not store.exists(uncommitted.name) and store.exists(part.name)
    # a rewrite cannot replace an object in place: a new name, and the old one removed by the same entry
    rewrite = writer.stage_part([{"id": 1, "error": None}], name=part.name)
    assert rewrite.name != part.name


def test_a_live_lease_refuses_a_second_holder(s3_out):
    store = open_store(s3_out)
    with Lease(store, ttl_s=30) as first:
        assert read_lease(store)["holder"] == first.holder_id
        assert lease_holder(store)["holder"] == first.holder_id
        with pytest.raises(OutputLocked, match="in use by another batchgen job"):
            Lease(store, ttl_s=30).acquire()
        first.check()  # still ours
    assert read_lease(store) is None and lease_holder(store) is None  # released: deleted


def test_an_expired_lease_is_taken_over(s3_out, caplog):
    store = open_store(s3_out)
    stale = {"holder": "someone-else", "pid": 1, "host": "another-host", "started": 0, "renewed": 0,
             "expires": time.time() - 1, "ttl_s": 60}
    store.write_bytes(LEASE_FILE, json.dumps(stale).encode())
    assert lease_holder(store) is None  # status: not running
    with caplog.at_level(logging.INFO, logger="batchgen.io.store.lease"), Lease(store, ttl_s=30) as lease:
        assert read_lease(store)["holder"] == lease.holder_id
    assert "taking over the lease" in caplog.text


def test_a_live_lease_on_another_host_is_not_taken_over(s3_out):
    store = open_store(s3_out)
    live = {"holder": "someone-else", "pid": 1, "host": "another-host", "started": 0, "renewed": 0,
            "expires": time.time() + 60, "ttl_s": 60}
    store.write_bytes(LEASE_FILE, json.dumps(live).encode())
    with pytest.raises(OutputLocked, match="expires in"):
        Lease(store).acquire()


def test_the_lease_is_renewed_and_a_takeover_stops_the_holder(s3_out):
    store = open_store(s3_out)
    lease = Lease(store, ttl_s=0.6)
    lease.acquire()
    try:
        first_expiry = read_lease(store)["expires"]
        time.sleep(0.9)  # past the first expiry: renewed every ttl/3
        assert read_lease(store)["expires"] > first_expiry
        lease.check()
        lease._stop.set()  # the job stalls: no more renewals
        lease._thread.join()
        time.sleep(0.7)  # past its expiry
        thief = Lease(store, ttl_s=30)
        thief.acquire()  # an expired lease is taken over (this pid is alive: by the expiry alone)
        with pytest.raises(OutputLocked, match="took it over"):
            lease.check()  # the stalled job commits nothing more
    finally:
        lease.release()
    assert read_lease(store)["holder"] == thief.holder_id  # release never deletes another holder's lease
    thief.release()


def test_manifest_refuses_to_commit_after_the_lease_is_lost(s3_out):
    store = open_store(s3_out)
    with Lease(store, ttl_s=30) as lease:
        manifest = Manifest(store, guard=lease)
        manifest.begin({"k": 1})
        store.write_bytes(LEASE_FILE, json.dumps(dict(read_lease(store), holder="thief")).encode())
        part, record = stage(PartWriter(store, SCHEMA), [1])
        with pytest.raises(OutputLocked):
            manifest.commit([(part, record)])
    assert load_manifest(store).parts == {}  # nothing committed; the part is garbage for recovery


def test_snapshots_and_partials_in_an_object_store(s3_out, monkeypatch):
    """A snapshot's rows file and a partials file: written whole (one PUT), committed by their entry."""
    from batchgen.io.manifest import manifest as manifest_module
    from batchgen.io.manifest.manifest import part_rows
    from batchgen.io.manifest.partials import PartialRow, read_partials, write_partials

    monkeypatch.setattr(manifest_module, "SNAPSHOT_EVERY_ENTRIES", 3)
    store = open_store(s3_out)
    writer = PartWriter(store, SCHEMA)
    manifest = Manifest(store)
    manifest.begin({"k": 1})
    for n in range(5):
        manifest.commit([stage(writer, [n])])
    state = load_manifest(store, keep_rows=True)
    assert state.snapshot_seq is not None and state.ok_ids == set(range(5))
    assert sorted(n for n in store.list("_manifest") if n.endswith(".rows.parquet")) == [state.snapshot_rows]
    first = min(state.parts)  # a part carried by the snapshot: its rows come from the rows file
    assert part_rows(store, load_manifest(store).parts[first]) == (["in.parquet"], [state.parts[first].ids[0]])
    rows = [PartialRow(7, "h", (1, 2, 3), None)]
    write_partials(manifest, rows, "fp")
    assert read_partials(store, load_manifest(store).partials, "fp") == {(7, 0): rows[0]}
    write_partials(manifest, [], "fp")
    assert [n for n in store.list("_manifest") if n.endswith(".partials.json")] == [
        load_manifest(store).partials["file"]]


def test_a_missing_bucket_fails_before_any_work(s3_out):
    from batchgen.errors import OutputError
    from batchgen.io.store.writers import check_output_dir

    bucket = s3_out.split("/")[2]
    with pytest.raises(OutputError, match="cannot write"):
        check_output_dir(s3_out.replace(bucket, bucket + "-missing"))
