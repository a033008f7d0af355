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
import socket
import time
from pathlib import Path

from batchgen.errors import OutputError, OutputLocked

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger(__name__)

LOCK_FILE = "_batchgen.lock"


class OutputLock:
    """`with OutputLock(out_dir):` or acquire()/release(); the directory must exist."""

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

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
                raise OutputLocked(f"{self.path.parent} is in use by another batchgen job{_describe(holder)}; "
                                   "wait for it to finish, stop it, or choose another --output") from None
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
                if holder and not _is_dead(holder):
                    raise OutputLocked(f"{self.path.parent} is in use by another batchgen job"
                                       f"{_describe(holder)}; wait for it to finish, stop it, or choose "
                                       "another --output") from None
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
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(info).encode())


def lock_holder(out_dir: str | Path) -> dict | None:
    """{"pid", "host", "started"} of the job holding `out_dir`'s lock, else None.

    Decided from the file, never by locking it: a probe that took the lock even for a moment
    could make a job starting at that instant fail. A lock file naming a pid that no longer
    runs on this host is what a killed job leaves: not held.
    """
    holder = _read_holder_path(Path(out_dir) / LOCK_FILE)
    return holder if holder and not _is_dead(holder) else None


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


def _is_dead(holder: dict) -> bool:
    """Only a pid on this host can be checked; a lock from another host is presumed live."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        pid = int(holder["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, ValueError, TypeError):
        return False
    try:  # a killed process stays a zombie until its parent reaps it: dead all the same
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
