"""One job per object-store output: a lease object `_batchgen.lease` with a holder id and an expiry.

An object store has no flock, and a killed job cannot drop anything, so the lock of a local
directory (batchgen.io.store.lock) becomes a lease:

    {"holder": random id of this run, "epoch", "pid", "host", identity (batchgen.io.store.claim),
     "started", "renewed", "expires": unix time, "ttl_s": seconds}

- first, once per store and process, the store is probed (ObjectStore.check_conditional_writes): a
  server that ignores If-None-Match / If-Match fences nothing below, and is refused (exit 2) unless
  BATCHGEN_UNSAFE_STORE=1 accepts it.
- acquire: read the lease; one not expired refuses the job (OutputLocked, exit 2), whoever holds
  it: a holder that looks dead from here may be a live job in another container with the same
  host name, and taking its lease over would let two jobs commit at once. An expired one is taken
  over. The lease is written with a conditional PUT (batchgen.io.store.conditional_put): created only if
  absent, replaced only if it is still the version read, so two jobs racing for it cannot both
  win; it is then read back after LEASE_SETTLE_S all the same.
- the epoch fences a superseded holder: every taker's is above the one it replaced (and above the
  clock in microseconds, so above any earlier job's), and every manifest entry carries it
  (batchgen.io.manifest.manifest): a job that finds an entry of a lower epoch in its way knows its writer
  lost the lease and writes past it; readers follow the entries the current holder chained.
- while the job runs, a daemon thread renews the lease every ttl/3, conditionally on the version
  it wrote last: a renewal never replaces another holder's lease.
- before every manifest entry the job checks the lease (`check`): read back, still ours, and at
  least LEASE_MARGIN of it left (renewed on the spot when less); else OutputLocked, and the job
  commits nothing more. Requests time out well inside the margin (batchgen.io.store.object_store).
- release deletes the lease if it is still ours.

The expiry is read against the reader's clock, so hosts' clocks must agree to well within the
TTL (NTP). The TTL is LEASE_TTL_S (60 s), or the BATCHGEN_LEASE_TTL_S environment variable: a job
stalled for longer than that (a stuck mount, a paused VM) may be taken over, and then stops at its
next commit, its entries ignored.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from batchgen.errors import AlreadyExists, OutputError, OutputLocked
from batchgen.io.store.claim import OutputClaim, holder_is_dead, holder_record, in_use_message
from batchgen.io.store.store import OutputStore

log = logging.getLogger(__name__)

LEASE_FILE = "_batchgen.lease"
LEASE_TTL_S = 60.0
LEASE_SETTLE_S = 0.5  # between writing our lease and reading it back (a racing writer lands in it)
TTL_ENV = "BATCHGEN_LEASE_TTL_S"
READ_ATTEMPTS = 5
LEASE_MARGIN = 0.25  # of the TTL: a commit needs this much lease left (request timeouts are ttl/6)


def lease_ttl_s() -> float:
    text = os.environ.get(TTL_ENV)
    if not text:
        return LEASE_TTL_S
    try:
        ttl = float(text)
    except ValueError:
        raise OutputError(f"{TTL_ENV}={text!r} is not a number of seconds") from None
    if ttl <= 0:
        raise OutputError(f"{TTL_ENV}={text!r} must be positive")
    return ttl


class Lease(OutputClaim):
    """`with Lease(store):` or acquire()/release(); `check()` before each commit."""

    def __init__(self, store: OutputStore, *, ttl_s: float | None = None):
        self.store = store
        self.ttl_s = ttl_s if ttl_s is not None else lease_ttl_s()
        self.holder_id = uuid.uuid4().hex
        self.started = 0.0
        self.expires = 0.0
        self.epoch = 0  # set on acquire: above every earlier holder's (the module docstring)
        self._version: str | None = None  # the lease object's version as this job last wrote it
        self.lost: str | None = None  # why this job no longer holds the lease
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()  # the renewal thread and release never write at once

    @property
    def held(self) -> bool:
        return self._held

    def acquire(self) -> None:
        assert not self._held, "already held"
        check_store = getattr(self.store, "check_conditional_writes", None)
        if check_store is not None:  # the fencing below rests on the store's conditional writes
            check_store()
        current, version = read_lease_versioned(self.store)
        if current is not None and not _expired(current):  # never taken over before its expiry
            raise OutputLocked(_in_use(self.store, current))
        if current is not None:
            log.info("taking over the lease on %s left by pid %s on %s (expired)", self.store, current.get("pid"),
                     current.get("host"))
        self.started = time.time()
        self.epoch = max(_epoch(current) + 1, time.time_ns() // 1000)
        # created where there is no object; replaced, if unchanged, where there is one (expired, or not a lease)
        if not self._write(create=version is None and current is None, version=version):
            raise OutputLocked(f"{self.store} is being taken by another batchgen job; try again")
        time.sleep(LEASE_SETTLE_S)
        current = read_lease(self.store)
        if current is None or current.get("holder") != self.holder_id:
            raise OutputLocked(_in_use(self.store, current) if current else
                               f"{self.store} is being taken by another batchgen job; try again")
        self._held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="batchgen-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise OutputLocked unless this job still holds the lease (read back from the store) with at
        least LEASE_MARGIN of its TTL left."""
        assert self._held, "not held"
        if self.lost is None:
            try:
                current = read_lease(self.store)
            except OutputError as e:
                current = {"holder": self.holder_id} if time.time() < self.expires else None
                log.warning("could not read the lease on %s: %s", self.store, e)
            if current is None or current.get("holder") != self.holder_id:
                self.lost = "another job took it over" if current else "it was removed"
            elif self.expires - time.time() < self.ttl_s * LEASE_MARGIN:
                with self._write_lock:  # the renewal thread fell behind: renew before committing on a short lease
                    self._renew()
                if self.lost is None and self.expires - time.time() < self.ttl_s * LEASE_MARGIN:
                    self.lost = "too little of it was left to commit safely, and it could not be renewed"
        if self.lost is not None:
            raise OutputLocked(f"this job no longer holds the lease on {self.store} ({self.lost}); it stopped "
                               "without committing more. Check for another job on this output, then rerun")

    def release(self) -> None:
        if not self._held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._held = False
        with self._write_lock:
            try:
                current = read_lease(self.store)
                if current is not None and current.get("holder") == self.holder_id:
                    self.store.delete(LEASE_FILE)
            except OutputError as e:  # the lease expires on its own
                log.warning("could not remove the lease on %s: %s", self.store, e)

    def _write(self, *, create: bool = False, version: str | None = None) -> bool:
        """Write our lease: created if absent (`create`), else replacing `version` where the store
        can condition on it; False when another writer got there first."""
        now = time.time()
        expires = now + self.ttl_s
        info = {"holder": self.holder_id, "epoch": self.epoch, **holder_record(self.started), "renewed": now,
                "expires": expires, "ttl_s": self.ttl_s}
        data = json.dumps(info).encode()
        create_fn, replace_fn = getattr(self.store, "create", None), getattr(self.store, "replace_if", None)
        if create and create_fn is not None:
            try:
                self._version = create_fn(LEASE_FILE, data)
            except AlreadyExists:
                return False
        elif version is not None and replace_fn is not None:
            new_version = replace_fn(LEASE_FILE, data, version)
            if new_version is None:
                return False
            self._version = new_version
        else:
            self.store.write_bytes(LEASE_FILE, data)
        self.expires = expires
        return True

    def _renew(self) -> None:
        """One renewal, under the write lock's caller; sets `lost` when the lease is no longer ours."""
        if time.time() >= self.expires:  # unrenewed past the expiry: another job may hold it now,
            self.lost = "it expired before it could be renewed"  # and a write would clobber theirs
            log.warning("lost the lease on %s: %s", self.store, self.lost)
            return
        try:
            current, version = read_lease_versioned(self.store)
            if current is None or current.get("holder") != self.holder_id:
                self.lost = "another job took it over" if current else "it was removed"
            elif not self._write(version=version if self._version is not None else None):
                self.lost = "another job took it over"
            if self.lost is not None:
                log.warning("lost the lease on %s: %s", self.store, self.lost)
        except OutputError as e:  # a blip: the next renewal, or the expiry, decides
            log.warning("could not renew the lease on %s: %s", self.store, e)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._write_lock:
                if self._stop.is_set() or self.lost is not None:
                    return
                self._renew()
                if self.lost is not None:
                    return


def read_lease(store: OutputStore) -> dict[str, Any] | None:
    """The lease object, or None when there is none."""
    return read_lease_versioned(store)[0]


def read_lease_versioned(store: OutputStore) -> tuple[dict[str, Any] | None, str | None]:
    """(the lease object or None, its version token where the store has one).

    pyarrow reads an object with a HEAD (its size) and then ranged GETs: a renewal between the two
    yields a cut or overlong read that does not parse. That is retried (an SDK's single GET is
    whole); an object that never parses is not a batchgen lease and counts as none."""
    read_versioned = getattr(store, "read_versioned", None)
    for attempt in range(READ_ATTEMPTS):
        version = None
        try:
            if read_versioned is not None:
                data, version = read_versioned(LEASE_FILE)
            else:
                data = store.read_bytes(LEASE_FILE)
        except FileNotFoundError:
            return None, None
        except OSError as e:
            raise OutputError(f"cannot read {store / LEASE_FILE}: {e}") from e
        try:
            lease = json.loads(data)
        except ValueError:
            time.sleep(0.05 * (attempt + 1))
            continue
        return (lease, version) if isinstance(lease, dict) else (None, version)
    return None, version


def lease_holder(store: OutputStore) -> dict[str, Any] | None:
    """{"pid", "host", "started", "expires", ...} of the live job holding `store`'s lease, else None."""
    try:
        lease = read_lease(store)
    except OutputError:
        return None
    return lease if lease is not None and _live(lease) else None


def _expired(lease: dict[str, Any]) -> bool:
    try:
        return time.time() >= float(lease["expires"])
    except (KeyError, TypeError, ValueError):
        return True


def _live(lease: dict[str, Any]) -> bool:
    """For status and finalize: unexpired and not known dead here (acquire waits for the expiry)."""
    return not _expired(lease) and not holder_is_dead(lease)


def _epoch(lease: dict[str, Any] | None) -> int:
    try:
        return int(lease["epoch"]) if lease else 0
    except (KeyError, TypeError, ValueError):
        return 0


def _in_use(store: OutputStore, lease: dict[str, Any]) -> str:
    left = max(float(lease.get("expires", 0)) - time.time(), 0.0)
    return in_use_message(store, f" (pid {lease.get('pid')} on {lease.get('host')}; its lease expires in {left:.0f} s "
                                 "unless renewed)")
