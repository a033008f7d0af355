"""Fault-injection soak of the commit protocol: what schedulers do to jobs, on local disk and S3.

One seed, in-process and on the protocol's own functions (no model: rows are made up, each id's
row known in advance), for tests/jobs/durability/test_fault_soak.py (a few seeds) and
benchmarks/soaks/fault_soak.py (many). Three scenarios (SCENARIOS):

- "stall": two writers on one output: A commits a few batches, then stalls at a random fault
  point of its next commit (staging a part, writing the entry, publishing) past its lease, as
  SIGSTOP would; meanwhile B takes the output over (on S3, once the lease expires; on local disk
  B is refused, the flock being held) and finishes the job, writing `_SUCCESS`; then A resumes
  and must commit nothing more (or, on local disk, it finishes the job itself);
- "late_entry": A commits some rows as error rows, then a retry of them that replaces their
  parts, and stalls in that commit past its lease: at a random staging write, or after its lease
  check, right before its entry is written. B takes the output over (loads the manifest, runs
  recovery) while A is stalled, then A wakes, and where it stalled at the entry, that entry lands
  before B writes any (B writes past it); then B finishes the job. A must delete nothing B commits;
- "unfenced": the store takes If-None-Match / If-Match and ignores them (an old S3-compatible
  server; S3 only): A must be refused before it writes anything (exit 2's UnsupportedOutputError).
- `status` polled in a thread the whole time: it must never call the manifest damaged;
- then the output is read as a plain listing (`**/*.parquet`, what `_SUCCESS` vouches for) and
  through the manifest, and counted (tests/jobs/durability/fault_counts.py): rows lost, duplicated, "mixed"
  (a listed part that no entry commits, or a committed part that is not there) and "stale" (a row
  of A committed after it lost the lease); and every `_SUCCESS` is checked against the parts that exist.

The race of finalize and compact over a sharded job's Batch files: tests/jobs/durability/finalize_race.py.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pyarrow as pa

from batchgen.errors import OutputError, OutputLocked, UnsupportedOutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE, Manifest, check_parts_present, load_manifest, write_success
from batchgen.io.store import local_files
from batchgen.io.store.conditional_put import ConditionalPut
from batchgen.io.store.lease import Lease
from batchgen.io.store.object_store import ObjectStore
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands.status import job_status
from batchgen.jobs.durability.commit import Committer
from tests.jobs.durability.fault_counts import NUM_ROWS, SeedResult, count

__all__ = ["NUM_ROWS", "SCENARIOS", "SeedResult", "run_seed"]
BATCH = 4
TTL_S = 1.0  # A's lease on S3: short, so a stall outlives it within a second
TTL_B_S = 30.0  # B never stalls
SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string()), ("text", pa.string())])
FAULT_POINTS = ("write", "fsync", "rename", "file_write", "file_fsync", "file_rename", "file_fsync_dir")
SCENARIOS = ("stall", "late_entry", "unfenced")


def _claim(store: OutputStore, ttl_s: float = TTL_S):
    return Lease(store, ttl_s=ttl_s) if not isinstance(store, LocalStore) else store.lock()


def _commit_ids(committer: Committer, ids: list[int], tag: str, errors: set[int] = frozenset()) -> None:
    for start in range(0, len(ids), BATCH):
        for i in ids[start:start + BATCH]:
            committer.add({"id": i, "error": "boom" if i in errors else None, "text": f"{tag}:{i}"}, "in.parquet", i)
        committer.commit()


def _take_over(store: OutputStore, claim) -> Manifest:
    """A new holder's start: load the manifest and finish what a crash (or a stalled job) left."""
    manifest = Manifest(store, load_manifest(store), guard=claim)
    damaged = manifest.recover()
    if damaged:
        manifest.commit([], [r.name for r in damaged], op="repair")
    if manifest.state.fingerprint is None:
        manifest.begin({"soak": 1})
    return manifest


def _complete(manifest: Manifest, tag: str) -> None:
    """The rest of a run, as batchgen.jobs.commands.run ends one: every row not committed ok (error
    rows retried), the sweep, the check of every committed part, then _SUCCESS."""
    todo = [i for i in range(NUM_ROWS) if i not in manifest.state.ok_ids]
    _commit_ids(Committer(manifest, PartWriter(manifest.store, SCHEMA), "id", rows_per_part=BATCH), todo, tag)
    manifest.sweep()
    check_parts_present(manifest.store, manifest.state)
    write_success(manifest.store, {"rows": manifest.state.num_committed_rows})


def _stop_renewals(claim) -> None:
    if isinstance(claim, Lease):
        claim._stop.set()
        if claim._thread is not None:
            claim._thread.join()


def _pause_past_lease(claim) -> None:
    """SIGSTOP: no renewals, and on S3 the lease runs out."""
    _stop_renewals(claim)
    if isinstance(claim, Lease):
        time.sleep(max(claim.expires - time.time(), 0) + 0.02)


def _poll(store: OutputStore, stop: threading.Event, result: SeedResult) -> None:
    while not stop.is_set():
        try:
            if store.is_dir("_manifest"):
                job_status(store)
                result.polls += 1
        except OutputError as e:
            if "damaged" in str(e):
                result.damaged_polls += 1
                result.notes.append(f"status: {e}")
        time.sleep(0.005)


def run_seed(seed: int, store: OutputStore, kind: str, scenario: str = "stall") -> SeedResult:
    """One seed of `scenario` on `store` (a fresh, empty output)."""
    if scenario == "unfenced":
        return _run_unfenced(seed, store, kind)
    result = SeedResult(seed, kind, scenario)
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(store, stop, result), daemon=True)
    poller.start()
    try:
        a_late = (_run_stall if scenario == "stall" else _run_late_entry)(random.Random(seed), store, result)
    finally:
        stop.set()
        poller.join()
    count(store, result, a_late)
    return result


def _as_a(result: SeedResult, run: Callable[[], None]) -> None:
    """Run A's part; how it ended goes to `result.a_stopped` (an error is counted, not raised)."""
    try:
        run()
        result.a_stopped = "finished"
    except OutputLocked as e:
        result.a_stopped = "refused: " + str(e)[:80]
    except (OSError, OutputError) as e:  # e.g. a part it commits deleted under it
        result.a_stopped = f"failed: {type(e).__name__}: {str(e)[:120]}"
    finally:
        local_files._fault_hook = None


def _run_stall(rng: random.Random, store: OutputStore, result: SeedResult) -> set[int]:
    """The "stall" scenario; the ids A had not committed when it stalled."""
    before = rng.randrange(1, 4) * BATCH
    stall_at = rng.randrange(1, 6)  # the n-th fault point of A's commits after the first `before` rows
    claim_a = _claim(store)
    claim_a.acquire()
    manifest = Manifest(store, load_manifest(store), guard=claim_a)
    committed_before_stall: set[int] = set()
    events = []

    def stall(point: str) -> None:
        if point not in FAULT_POINTS or len(events) >= stall_at:
            return
        events.append(point)
        if len(events) < stall_at:
            return
        local_files._fault_hook = None  # B's own writes run unhindered
        _pause_past_lease(claim_a)
        committed_before_stall.update(manifest.state.ok_ids)
        claim_b = _claim(store, TTL_B_S)
        try:
            claim_b.acquire()
        except OutputLocked:
            result.notes.append("B refused while A held the output")
            return
        try:
            _complete(_take_over(store, claim_b), "B")
        except (OSError, OutputError) as e:  # counted as B's, not raised as if A had failed
            result.b_failed = f"{type(e).__name__}: {str(e)[:160]}"
        finally:
            claim_b.release()

    def run_a() -> None:
        manifest.recover()
        manifest.begin({"soak": 1})
        committer = Committer(manifest, PartWriter(store, SCHEMA), "id", rows_per_part=BATCH)
        _commit_ids(committer, list(range(before)), "A")
        local_files._fault_hook = stall
        _commit_ids(committer, list(range(before, NUM_ROWS)), "A")
        manifest.sweep()
        check_parts_present(store, manifest.state)
        write_success(store, {"rows": manifest.state.num_committed_rows})

    try:
        _as_a(result, run_a)
    finally:
        claim_a.release()
    if not committed_before_stall:
        _retry_after_lapse(store, result)
    return set(range(NUM_ROWS)) - committed_before_stall if committed_before_stall else set()


def _run_late_entry(rng: random.Random, store: OutputStore, result: SeedResult) -> set[int]:
    """The "late_entry" scenario; the ids A had not committed ok when it stalled."""
    before = rng.randrange(2, 5) * BATCH
    errors = {i for i in range(before) if rng.random() < 0.4} or {0}
    retry = sorted(errors) + list(range(before, before + BATCH))  # the error rows retried, and new rows
    at_entry = rng.random() < 0.7  # else at a random write while A stages the retry's parts
    stall_at = rng.randrange(1, 1 + len(retry) // BATCH + 1)
    claim_a = _claim(store)
    claim_a.acquire()
    manifest = Manifest(store, load_manifest(store), guard=claim_a)
    b: list[tuple[object, Manifest]] = []
    committed_before_stall: set[int] = set()

    def take_over() -> None:
        local_files._fault_hook = None
        _pause_past_lease(claim_a)
        committed_before_stall.update(manifest.state.ok_ids)
        claim_b = _claim(store, TTL_B_S)
        try:
            claim_b.acquire()
        except OutputLocked:
            result.notes.append("B refused while A held the output")
            return
        b.append((claim_b, _take_over(store, claim_b)))

    real_write_entry = manifest._write_entry

    def write_entry(build: Callable[[int], dict]) -> dict:  # after A's lease check: its entry lands first
        if b or committed_before_stall:
            return real_write_entry(build)
        take_over()
        entry = real_write_entry(build)
        result.late_entry_landed = bool(b)
        return entry

    writes = []

    def stall(point: str) -> None:
        if point in ("write", "file_write"):
            writes.append(point)
            if len(writes) == stall_at:
                take_over()

    def run_a() -> None:
        manifest.recover()
        manifest.begin({"soak": 1})
        committer = Committer(manifest, PartWriter(store, SCHEMA), "id", rows_per_part=BATCH)
        _commit_ids(committer, list(range(before)), "A", errors)
        if at_entry:
            manifest._write_entry = write_entry
        else:
            local_files._fault_hook = stall
        _commit_ids(committer, retry, "A")  # in batches: the first carries the retried rows
        _complete(manifest, "A")

    try:
        _as_a(result, run_a)
    finally:
        manifest.__dict__.pop("_write_entry", None)
        claim_a.release()
    if not b and not committed_before_stall:
        _retry_after_lapse(store, result)
    for claim_b, manifest_b in b:
        try:
            _complete(manifest_b, "B")
        except (OSError, OutputError) as e:  # a part it commits was deleted under it: counted, not raised
            result.b_failed = f"{type(e).__name__}: {str(e)[:160]}"
        finally:
            claim_b.release()
    return set(range(NUM_ROWS)) - committed_before_stall if committed_before_stall else set()


def _retry_after_lapse(store: OutputStore, result: SeedResult) -> None:
    """A's lease lapsed before the stall (its renewals starved on a busy machine: a 1 s lease) and
    it stopped: the scheduler's retry finishes the job. The seed tested no takeover: counted."""
    if result.a_stopped == "finished":
        return
    result.lapsed_before_stall = True
    claim = _claim(store, TTL_B_S)
    claim.acquire()
    try:
        _complete(_take_over(store, claim), "B")
    except (OSError, OutputError) as e:
        result.b_failed = f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        claim.release()


class IgnoredConditions(ConditionalPut):
    """A server that takes If-None-Match / If-Match and ignores them: every PUT lands."""

    def __init__(self, inner: ConditionalPut):
        self.inner = inner
        self.where = f"ignoring {inner.where}"

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_version: str | None = None) -> str:
        return self.inner.put(key, data)

    def read(self, key: str) -> tuple[bytes, str]:
        return self.inner.read(key)


def _run_unfenced(seed: int, store: OutputStore, kind: str) -> SeedResult:
    """The "unfenced" scenario: A must be refused before it writes anything."""
    result = SeedResult(seed, kind, "unfenced")
    assert isinstance(store, ObjectStore), "a local directory's exclusive writes are link(2), not headers"
    unfenced = ObjectStore(store.fs, store.base, store.url, IgnoredConditions(store.conditional))
    claim = _claim(unfenced, TTL_B_S)
    try:
        claim.acquire()
        result.a_stopped = "took the lease"
        claim.release()
    except UnsupportedOutputError as e:
        result.a_stopped = "refused: " + str(e)[:60]
    result.mixed = len(store.list())  # objects left behind
    result.success = store.exists(SUCCESS_FILE)
    return result
