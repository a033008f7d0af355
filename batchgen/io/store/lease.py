"""One job per object-store output: a lease object `_batchgen.lease` with a holder id and an expiry.

An object store has no flock, and a killed job cannot drop anything, so the lock of a local
directory (batchgen.io.store.lock) becomes a lease:

    {"holder": random id of this run, "pid", "host", "started", "renewed", "expires": unix time,
     "ttl_s": seconds}

- acquire: read the lease; one held by another holder and not expired refuses the job
  (OutputLocked, exit 2). An expired one is taken over, and so is one whose pid no longer runs on
  this host (a job killed here and retried here need not wait for the expiry). Then write ours,
  wait LEASE_SETTLE_S and read it back: a second job that raced us past the read sees its own id
  replaced and stops, before it wrote anything.
- while the job runs, a daemon thread renews the lease every ttl/3 (a new expiry).
- before every manifest entry the job reads the lease back (`check`): if another holder took it
  over (this job stalled past the expiry) the job stops with OutputLocked and commits nothing more.
- release deletes the lease if it is still ours.

pyarrow.fs offers no conditional PUT, so two jobs starting within the same instant are kept apart
by the read-back, not by the store; and the expiry is read against the reader's clock, so hosts'
clocks must agree to well within the TTL (NTP). The TTL is LEASE_TTL_S (60 s), or the
BATCHGEN_LEASE_TTL_S environment variable: a job stalled for longer than that (a stuck mount, a
paused VM) may be taken over, and then stops at its next commit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from batchgen.errors import OutputError, OutputLocked
from batchgen.io.store.claim import OutputClaim, holder_is_dead, holder_record, in_use_message
from batchgen.io.store.store import OutputStore

log = logging.getLogger(__name__)

LEASE_FILE = "_batchgen.lease"
LEASE_TTL_S = 60.0
LEASE_SETTLE_S = 0.5  # between writing our lease and reading it back (a racing writer lands in it)
TTL_ENV = "BATCHGEN_LEASE_TTL_S"
READ_ATTEMPTS = 5


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
        current = read_lease(self.store)
        if current is not None and _live(current):
            raise OutputLocked(_in_use(self.store, current))
        if current is not None:
            log.info("taking over the lease on %s left by pid %s on %s (%s)", self.store, current.get("pid"),
                     current.get("host"), "expired" if _expired(current) else "no longer running")
        self.started = time.time()
        self._write()
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
        """Raise OutputLocked unless this job still holds the lease (read back from the store)."""
        assert self._held, "not held"
        if self.lost is None:
            try:
                current = read_lease(self.store)
            except OutputError as e:
                current = {"holder": self.holder_id} if time.time() < self.expires else None
                log.warning("could not read the lease on %s: %s", self.store, e)
            if current is None or current.get("holder") != self.holder_id:
                self.lost = "another job took it over" if current else "it was removed"
            elif time.time() >= self.expires:
                self.lost = "it expired before it could be renewed"
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

    def _write(self) -> None:
        now = time.time()
        self.expires = now + self.ttl_s
        info = {"holder": self.holder_id, **holder_record(self.started), "renewed": now, "expires": self.expires,
                "ttl_s": self.ttl_s}
        self.store.write_bytes(LEASE_FILE, json.dumps(info).encode())

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._write_lock:
                if self._stop.is_set():
                    return
                if time.time() >= self.expires:  # unrenewed past the expiry: another job may hold it now,
                    self.lost = "it expired before it could be renewed"  # and a write would clobber theirs
                    log.warning("lost the lease on %s: %s", self.store, self.lost)
                    return
                try:
                    current = read_lease(self.store)
                    if current is None or current.get("holder") != self.holder_id:
                        self.lost = "another job took it over" if current else "it was removed"
                        log.warning("lost the lease on %s: %s", self.store, self.lost)
                        return
                    self._write()
                except OutputError as e:  # a blip: the next renewal, or the expiry, decides
                    log.warning("could not renew the lease on %s: %s", self.store, e)


def read_lease(store: OutputStore) -> dict[str, Any] | None:
    """The lease object, or None when there is none.

    pyarrow reads an object with a HEAD (its size) and then ranged GETs: a renewal between the two
    yields a cut or overlong read that does not parse. That is retried; an object that never
    parses is not a batchgen lease and counts as none."""
    for attempt in range(READ_ATTEMPTS):
        try:
            data = store.read_bytes(LEASE_FILE)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise OutputError(f"cannot read {store / LEASE_FILE}: {e}") from e
        try:
            lease = json.loads(data)
        except ValueError:
            time.sleep(0.05 * (attempt + 1))
            continue
        return lease if isinstance(lease, dict) else None
    return None


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
    return not _expired(lease) and not holder_is_dead(lease)


def _in_use(store: OutputStore, lease: dict[str, Any]) -> str:
    left = max(float(lease.get("expires", 0)) - time.time(), 0.0)
    return in_use_message(store, f" (pid {lease.get('pid')} on {lease.get('host')}; its lease expires in {left:.0f} s "
                                 "unless renewed)")
