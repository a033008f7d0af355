"""One job per output directory: an exclusive lock on `_batchgen.lock` while a job runs.

POSIX: `flock` on the lock file. The kernel drops the lock when its holder exits in any way
(kill -9 included), so a lock left by a dead process is never stale: the file may still name
the dead pid, but the lock is free, and the next job takes it over and says so. The file's
contents (pid, host, start time) only make the "in use" message useful.

Releasing unlinks the file while still holding the lock. A job that opened the old file just
before that would lock an unlinked inode, so `acquire` checks that the path still names the
inode it locked and retries otherwise.

Without fcntl (Windows) the lock is the file's existence (O_EXCL) and staleness is decided
from the recorded pid: same host and no such process -> taken over.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from batchgen.errors import OutputError, OutputLocked
from batchgen.io.store.claim import (
    OutputClaim,
    holder_is_dead,
    holder_record,
    in_use_message,
    same_kernel_and_namespace,
)

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger(__name__)

LOCK_FILE = "_batchgen.lock"


class OutputLock(OutputClaim):
    """`with OutputLock(out_dir):` or acquire()/release(); the directory must exist."""

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / LOCK_FILE
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> None:
        assert self.fd is None, "already held"
        try:
            if fcntl is None:
                self._acquire_exclusive_create()
            else:
                self._acquire_flock()
        except OSError as e:
            raise OutputError(f"cannot create the lock file {self.path}: {e.strerror or e}") from e

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: see the module docstring
        except OSError:
            log.warning("could not remove %s", self.path)
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def _acquire_flock(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise OutputLocked(in_use_message(self.path.parent, _describe(holder))) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder unlinked it between our open and our flock
        self._take(fd)

    def _acquire_exclusive_create(self) -> None:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                holder = _read_holder_path(self.path)
                if holder and not holder_is_dead(holder):
                    raise OutputLocked(in_use_message(self.path.parent, _describe(holder))) from None
                self.path.unlink(missing_ok=True)
        self.fd = fd
        self._write_holder(fd)

    def _take(self, fd: int) -> None:
        previous = _read_holder(fd)
        if previous and previous.get("pid") != os.getpid():
            log.info("taking over the lock on %s left by pid %s, which is no longer running",
                     self.path.parent, previous.get("pid"))
        self.fd = fd
        self._write_holder(fd)

    def _write_holder(self, fd: int) -> None:
        info = holder_record(time.time())
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(info).encode())


def lock_holder(out_dir: str | Path) -> dict | None:
    """{"pid", "host", "started", ...} of the job holding `out_dir`'s lock, else None.

    Decided without locking: a probe that took the lock even for a moment could make a job
    starting at that instant fail. The kernel's lock table (/proc/locks) says whether anyone
    holds the file's flock, in any pid namespace: held is held; not held counts as free when
    the holder ran under this kernel (a killed job's leftover file). Without the table, a holder
    is free only when its whole identity shows it dead (batchgen.io.store.claim).
    """
    path = Path(out_dir) / LOCK_FILE
    holder = _read_holder_path(path)
    if not holder:
        return None
    flocked = _flocked(path)
    if flocked is True:
        return holder
    if flocked is False and same_kernel_and_namespace(holder):
        return None
    return None if holder_is_dead(holder) else holder


def _flocked(path: Path) -> bool | None:
    """Whether the kernel lists a flock on `path` (Linux /proc/locks), None when it cannot tell."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:
        return None
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"  # as the kernel prints it
    return any("FLOCK" in fields and file_id in fields for fields in map(str.split, table.splitlines()))


def _read_holder(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096)
        return json.loads(data) if data else None
    except (OSError, ValueError):
        return None


def _read_holder_path(path: Path) -> dict | None:
    try:
        return json.loads(path.read_bytes() or b"null")
    except (OSError, ValueError):
        return None


def _describe(holder: dict | None) -> str:
    if not holder:
        return ""
    started = holder.get("started")
    since = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if started else ""
    return f" (pid {holder.get('pid')} on {holder.get('host')}{since})"

