"""Trust in a cached kernel: a shared object is loaded only if this user built it and nobody else can change it.

Loading a `.so` runs its code in this process, and the cache may sit in a directory others can
write (a shared $XDG_CACHE_HOME, a team's BATCHGEN_CACHE_DIR). So:

- the cache directory must be one nobody else can change: it and every directory above it writable
  by no group or other user unless sticky (as /tmp is: nobody may rename or delete another's
  files there), and the cache directory itself owned by this user. `make_dir` creates the missing
  ones so whatever the umask; `dir_problem` says why an existing one is refused.
- a build publishes, next to each `<name>.so`, `<name>.so.sha256` holding the digest of the bytes
  it built, both files made read-only to group and others.
- before a cached file is loaded, `open_trusted` opens it (never through a symlink) and checks that
  very open file: a regular file owned by the current user, writable by no group or other user, its
  sha256 the recorded one (whose file passes the same ownership checks). The caller loads it
  through the open descriptor (`fd_path`), so a file renamed over the checked one in between is
  never the one loaded. A file that fails is built again (batchgen.engine.kernels.loader), never loaded.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

SUFFIX = ".sha256"
_DIR_MODE = 0o755  # readable by others (a kernel is no secret), writable by this user alone
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO must not block


class Untrusted(Exception):
    """A cached file that must not be loaded; str(e) says why."""


def digest_path(target: Path) -> Path:
    return target.with_name(target.name + SUFFIX)


def make_dir(path: Path) -> None:
    """Create `path` and its missing parents writable by this user alone, whatever the umask
    (which may leave new directories group-writable, as umask 002 does)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=_DIR_MODE)
        except FileExistsError:  # another job made it first: dir_problem checks it all the same
            continue
        os.chmod(directory, _DIR_MODE)  # mkdir's mode is cut by the umask, never widened


def dir_problem(directory: Path) -> str | None:
    """Why a kernel in `directory` could be swapped by someone else; None when it cannot."""
    path = directory.resolve()
    for current in (path, *path.parents):
        info = os.stat(current)
        if current == path and info.st_uid != os.geteuid():
            return f"{current} is owned by uid {info.st_uid}, not by this user"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            return f"{current} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}) and not sticky"
    return None


def open_trusted(target: Path) -> int:
    """A read-only descriptor of the cached `target`, checked as the module says; raises Untrusted.
    The caller closes it."""
    recorded_fd = _open_checked(digest_path(target))
    with os.fdopen(recorded_fd, "rb") as f:
        recorded = f.read(256).decode("ascii", "replace").strip()
    fd = _open_checked(target)
    try:
        if _sha256_fd(fd) != recorded:
            raise Untrusted(f"{target.name} does not match the sha256 its build recorded")
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> str:
    """A path that opens the file `fd` refers to, whatever is at its name now."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def problem(target: Path) -> str | None:
    """Why the cached `target` must not be loaded; None when it may be."""
    try:
        os.close(open_trusted(target))
    except Untrusted as e:
        return str(e)
    return None


def _open_checked(path: Path) -> int:
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise Untrusted(f"{path.name} is missing") from None
    except OSError as e:  # ELOOP: a symlink
        raise Untrusted(f"{path.name} cannot be opened as a plain file ({e.strerror})") from None
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = f"{path.name} is not a regular file"
    elif info.st_uid != os.geteuid():
        why = f"{path.name} is owned by uid {info.st_uid}, not by this user"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"{path.name} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    if why is not None:
        os.close(fd)
        raise Untrusted(why)
    return fd


def publish(built: Path, target: Path) -> None:
    """Move the freshly built `built` to `target`, recording its digest first (atomic renames, so
    a concurrent job sees a digest before the file it describes)."""
    os.chmod(built, 0o755)  # the umask may have left it group-writable, which `problem` refuses
    recorded = built.with_name(built.name + SUFFIX)
    recorded.write_text(sha256(built) + "\n")
    os.chmod(recorded, 0o644)
    os.replace(recorded, digest_path(target))
    os.replace(built, target)


def remove(target: Path) -> None:
    """Delete an untrusted cached file and its digest, so that it is built again."""
    for path in (target, digest_path(target)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()
