"""A job that stalls past its lease and wakes must not overwrite the commits of the job that took over.

Entries are written with a conditional PUT (If-None-Match: *), each carries the lease's epoch,
and readers follow the chain the newest holder wrote; a commit needs a margin of lease left."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from batchgen.errors import AlreadyExists, OutputLocked, UnsupportedOutputError
from batchgen.io.manifest.manifest import Manifest, PartRecord, check_parts_present, load_manifest
from batchgen.io.store import local_files
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import LEASE_MARGIN, Lease, read_lease
from batchgen.io.store.object_store import UNSAFE_STORE_ENV, request_timeouts
from batchgen.io.store.writers import PartWriter

pytestmark = pytest.mark.usefixtures("quick_lease_settle")

SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string())])


def staged(store, ids):
    part = PartWriter(store, SCHEMA).stage_part([{"id": i, "error": None} for i in ids])
    return part, PartRecord.staged(part, ids, [False] * len(ids), ["in.parquet"] * len(ids), ids)


def stall(lease: Lease) -> None:
    """The holder stops (SIGSTOP, a stuck mount): no renewals, and its lease runs out."""
    lease._stop.set()
    lease._thread.join()
    time.sleep(max(lease.expires - time.time(), 0) + 0.05)


def test_an_exclusive_write_never_replaces_an_object_that_appeared(s3_out, monkeypatch):
    store = open_store(s3_out)
    store.write_bytes("_manifest/00000001.json", b"theirs", exclusive=True)
    monkeypatch.setattr(type(store), "exists", lambda self, name: False)  # a check that raced the other PUT
    with pytest.raises(AlreadyExists):
        store.write_bytes("_manifest/00000001.json", b"ours", exclusive=True)
    assert store.read_bytes("_manifest/00000001.json") == b"theirs"  # before: replaced


def run_in_stall(monkeypatch, action):
    """Run `action` once, at the moment the next entry is about to be PUT (after the lease check)."""
    fired = []

    def hook(point: str) -> None:
        if point == "write" and not fired:
            fired.append(True)
            action()

    monkeypatch.setattr(local_files, "_fault_hook", hook)


def test_a_stalled_holder_cannot_replace_the_new_holders_entry(s3_out, monkeypatch):
    store = open_store(s3_out)
    old = Lease(store, ttl_s=0.6)
    old.acquire()
    a = Manifest(store, guard=old)
    a.begin({"k": 1})
    a.commit([staged(store, [1])])
    part = staged(store, [2])
    taken: list[Lease] = []

    def take_over_and_commit() -> None:
        stall(old)
        new = Lease(store, ttl_s=30)
        new.acquire()
        taken.append(new)
        b = Manifest(store, guard=new)
        b.recover()  # deletes the stalled job's staged part: no entry names it
        b.commit([staged(store, [3])])

    run_in_stall(monkeypatch, take_over_and_commit)
    with pytest.raises(OutputLocked):
        a.commit([part])  # before: its PUT replaced the new holder's entry 3
    monkeypatch.setattr(local_files, "_fault_hook", None)
    state = load_manifest(store)
    assert set(state.ok_ids) == {1, 3}
    assert all(store.exists(name) for name in state.parts)  # no entry names a deleted part
    taken[0].release()


def test_a_stalled_holders_late_entry_is_skipped_by_the_new_holder_and_readers(s3_out, monkeypatch):
    store = open_store(s3_out)
    old = Lease(store, ttl_s=0.6)
    old.acquire()
    a = Manifest(store, guard=old)
    a.begin({"k": 1})
    a.commit([staged(store, [1])])
    part = staged(store, [2])
    taken: list[tuple[Lease, Manifest]] = []

    def take_over() -> None:
        stall(old)
        new = Lease(store, ttl_s=30)
        new.acquire()
        b = Manifest(store, guard=new)
        b.recover()  # the stalled job's part goes: no entry names it yet
        taken.append((new, b))

    run_in_stall(monkeypatch, take_over)
    a.commit([part])  # lands in the free slot 3: its part already deleted
    monkeypatch.setattr(local_files, "_fault_hook", None)
    new, b = taken[0]
    assert read_lease(store)["epoch"] > old.epoch
    b.commit([staged(store, [2])])  # before: "appeared ... another process is writing"
    b.sweep()  # as before _SUCCESS
    state = load_manifest(store)
    assert set(state.ok_ids) == {1, 2} and state.last_seq == 4
    assert all(store.exists(name) for name in state.parts)
    new.release()


def test_a_commit_needs_a_margin_of_lease_left(s3_out):
    store = open_store(s3_out)
    lease = Lease(store, ttl_s=30)
    lease.acquire()
    try:
        lease._stop.set()
        lease._thread.join()
        lease.expires = time.time() + 30 * LEASE_MARGIN / 2  # as if the renewals fell behind
        lease.check()  # renewed on the spot: a full TTL again
        assert lease.expires - time.time() > 30 * (1 - LEASE_MARGIN)
        lease.store = type(store)(store.fs, store.base + "-elsewhere", store.url, store.conditional)
        lease.expires = time.time() + 30 * LEASE_MARGIN / 2
        with pytest.raises(OutputLocked):  # cannot renew (its lease is gone): refused, not 1 ms to spare
            lease.check()
    finally:
        lease.store = store
        lease._held = False


def test_requests_time_out_well_inside_the_lease():
    connect, request = request_timeouts(60)
    assert request <= 10 and connect <= request and request < 60 * LEASE_MARGIN


def test_an_object_that_is_not_a_lease_is_replaced(s3_out):
    store = open_store(s3_out)
    store.write_bytes("_batchgen.lease", b"not json")
    with Lease(store, ttl_s=30) as lease:
        assert read_lease(store)["holder"] == lease.holder_id


def test_without_the_sdk_an_s3_output_is_refused_not_written_unsafely(s3_out, monkeypatch):
    from batchgen.errors import UnsupportedOutputError
    from batchgen.io.store import conditional_put

    monkeypatch.setattr(conditional_put, "boto3", None)
    with pytest.raises(UnsupportedOutputError, match=r"needs boto3 .*batchgen\[s3\]"):
        open_store(s3_out)


def test_a_stalled_holders_entry_that_lands_first_removes_no_part_the_new_holder_commits(s3_out, monkeypatch):
    store = open_store(s3_out)
    old = Lease(store, ttl_s=0.6)
    old.acquire()
    a = Manifest(store, guard=old)
    a.begin({"k": 1})
    first = staged(store, [1, 2])
    a.commit([first])
    replaced = first[0].name
    rewrite = staged(store, [2])  # the part minus row 1 (a retried row), under a new name
    taken: list[tuple[Lease, Manifest]] = []

    def take_over() -> None:
        stall(old)
        new = Lease(store, ttl_s=30)
        new.acquire()
        b = Manifest(store, guard=new)
        b.recover()  # loaded before the stalled job's entry lands: `replaced` is committed here
        taken.append((new, b))

    run_in_stall(monkeypatch, take_over)
    with pytest.raises(OutputLocked):  # before: no error, and `replaced` deleted after the entry
        a.commit([rewrite], remove=[replaced])
    monkeypatch.setattr(local_files, "_fault_hook", None)
    new, b = taken[0]
    b.commit([staged(store, [3])])  # writes past the stalled job's entry
    b.sweep()
    check_parts_present(store, b.state)  # what _SUCCESS needs
    state = load_manifest(store)
    assert set(state.ok_ids) == {1, 2, 3} and replaced in state.parts
    assert all(store.exists(name) for name in state.parts)
    new.release()


def test_a_stalled_holders_snapshot_that_lands_first_drops_no_entry_the_new_holder_reads(s3_out, monkeypatch):
    store = open_store(s3_out)
    old = Lease(store, ttl_s=0.6)
    old.acquire()
    a = Manifest(store, guard=old)
    a.begin({"k": 1})
    a.commit([staged(store, [1])])
    taken: list[tuple[Lease, Manifest]] = []

    def take_over() -> None:
        stall(old)
        new = Lease(store, ttl_s=30)
        new.acquire()
        b = Manifest(store, guard=new)
        b.recover()
        taken.append((new, b))

    run_in_stall(monkeypatch, take_over)
    with pytest.raises(OutputLocked):  # before: no error, and entries 1-2 deleted after the snapshot
        a.snapshot()
    monkeypatch.setattr(local_files, "_fault_hook", None)
    new, b = taken[0]
    b.commit([staged(store, [2])])  # writes past the stalled job's snapshot: its chain is entries 1, 2, 4
    state = load_manifest(store)
    assert set(state.ok_ids) == {1, 2} and all(store.exists(name) for name in state.parts)
    new.release()


def ignore_conditions(monkeypatch) -> None:
    """An S3-compatible server that takes If-None-Match / If-Match and ignores them: every PUT lands."""
    from batchgen.io.store.conditional_put import S3ConditionalPut

    real_put = S3ConditionalPut.put
    monkeypatch.setattr(S3ConditionalPut, "put", lambda self, key, data, **conditions: real_put(self, key, data))


def test_a_store_that_ignores_conditional_writes_is_refused_unless_the_user_consents(s3_out, monkeypatch, caplog):
    ignore_conditions(monkeypatch)
    store = open_store(s3_out)
    with pytest.raises(UnsupportedOutputError, match=r"ignored If-None-Match.*BATCHGEN_UNSAFE_STORE=1") as e:
        Lease(store, ttl_s=30).acquire()  # before: taken, and later fenced by nothing
    assert e.value.exit_code == 2
    assert not store.list()  # no lease, no probe object left behind
    monkeypatch.setenv(UNSAFE_STORE_ENV, "1")
    with Lease(open_store(s3_out), ttl_s=30) as lease:
        assert read_lease(store)["holder"] == lease.holder_id
    assert "does not honour conditional writes" in caplog.text


def test_a_store_is_probed_once(s3_out, monkeypatch):
    from batchgen.io.store.conditional_put import S3ConditionalPut

    keys: list[str] = []
    real_put = S3ConditionalPut.put

    def put(self, key, data, **conditions):
        keys.append(key)
        return real_put(self, key, data, **conditions)

    monkeypatch.setattr(S3ConditionalPut, "put", put)
    for _ in range(2):
        with Lease(open_store(s3_out), ttl_s=30):
            pass
    assert sum(".fencing-probe-" in key for key in keys) == 4  # once: PUT, its repeat, If-Match current, then stale


def test_a_store_that_rejects_conditional_writes_is_refused_saying_why(s3_out, monkeypatch):
    from batchgen.errors import OutputError
    from batchgen.io.store.conditional_put import S3ConditionalPut

    def put(self, key, data, **conditions):
        raise OutputError(f"cannot write s3://{key}: An error occurred (NotImplemented) when calling PutObject")

    monkeypatch.setattr(S3ConditionalPut, "put", put)
    with pytest.raises(OutputError, match=r"cannot check that the store honours conditional writes .*NotImplemented"):
        Lease(open_store(s3_out), ttl_s=30).acquire()  # before: the SDK's error alone, about a hidden object
