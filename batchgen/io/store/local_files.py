"""Local files written so that a crash leaves the old file, no file, or the whole new one.

Temp file in the same directory, fsync, rename (or put-if-absent), directory fsync: what the local
store, the manifest's entries, `_SUCCESS` and the OpenAI Batch files rest on. Apart from the part
writers so that the local store can use them without importing the writers that use the store.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.errors import AlreadyExists, OutputError

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
# renameat2(2) for a put-if-absent where there are no hard links (_rename_noreplace)
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1
try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True) if os.name == "posix" else None
except OSError:
    _LIBC = None

# Tests set this to inject faults: called with "write", "fsync", "rename", "fsync_dir" before
# each stage of a part's write, with "file_write", "file_fsync", "file_rename",
# "file_fsync_dir" before each stage of write_file_atomic (manifest entries, _SUCCESS), with
# "fsync_staged" before a manifest commit fsyncs the staged parts' directory, and with
# "batch_file_rename" before each OpenAI Batch file is renamed into place; it may raise
# OSError(errno.ENOSPC, ...) and the like.
_fault_hook: Callable[[str], None] | None = None


def write_file_atomic(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write `data` to `path` so that a crash leaves the old file, or no file, or the new one."""
    write_with_atomic(path, lambda file: file.write(data), exclusive=exclusive)


def write_with_atomic(path: Path, write: Callable[[Any], None], *, exclusive: bool = False) -> None:
    """Have `write` fill `path` so that a crash leaves the old file, or no file, or the new one.

    Temp file in the same directory, fsync, rename, directory fsync. `exclusive` refuses to
    replace an existing file (a hard link instead of a rename, or a no-replace rename where there
    are no hard links: put-if-absent), which keeps a second writer that got past the lock from
    silently overwriting a manifest entry. A directory fsync that fails once the file is in place
    is reported (OutputError), and the file kept: the rename happened, and removing it now would
    lose what it replaced as well.
    """
    temp_path = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    placed = False
    try:
        with open(temp_path, "xb") as file:
            fault_point("file_write")
            write(file)
            fault_point("file_fsync")
            file.flush()
            os.fsync(file.fileno())
        fault_point("file_rename")
        if exclusive:
            _link_exclusive(temp_path, path)
        else:
            os.replace(temp_path, path)
        placed = True
        fault_point("file_fsync_dir")
        _fsync_dir(path.parent)
    except BaseException as e:
        if not placed:
            _remove_quietly(temp_path)
        if isinstance(e, FileExistsError):
            raise AlreadyExists(f"{path} appeared while this job was writing it: another process is "
                                "writing to this output directory") from e
        if isinstance(e, OSError):
            if placed:  # renamed: removing it now would lose the file it replaced too
                raise OutputError(f"wrote {path}, but could not sync its directory ({e.strerror or e}): it is in "
                                  "place, though a power cut might still undo it; check the disk") from e
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from e
        raise


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in bounded chunks."""
    digest = hashlib.sha256()
    num_bytes = 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
            num_bytes += len(chunk)
    return num_bytes, digest.hexdigest()


def fsync_dir(path: str | Path) -> None:
    """Make renames and unlinks in `path` durable."""
    _fsync_dir(Path(path))


def _link_exclusive(temp_path: Path, path: Path) -> None:
    """Publish `temp_path` as `path` only if `path` does not exist (FileExistsError otherwise)."""
    try:
        os.link(temp_path, path)  # fails with FileExistsError if `path` exists
    except FileExistsError:
        raise
    except OSError as e:  # a filesystem without hard links: a rename that refuses to replace
        _rename_noreplace(temp_path, path, e)
        return
    os.unlink(temp_path)


def _rename_noreplace(temp_path: Path, path: Path, link_error: OSError) -> None:
    """renameat2(RENAME_NOREPLACE) (Linux); where the filesystem has neither it nor hard links, refuse:
    a plain rename would replace an entry another writer just made."""
    renameat2 = getattr(_LIBC, "renameat2", None) if _LIBC is not None else None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(temp_path), _AT_FDCWD, os.fsencode(path), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(path))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
            raise OSError(err, os.strerror(err), str(path))
    raise OutputError(f"cannot write {path} exclusively: its filesystem supports neither hard links "
                      f"({link_error.strerror or link_error}) nor a rename that refuses to replace a file; a batchgen "
                      "output needs one of them (a local disk or NFS has both)")


def fault_point(name: str) -> None:
    """Where a test's _fault_hook may inject a failure (see above)."""
    if _fault_hook is not None:
        _fault_hook(name)


def _fsync_dir(path: Path) -> None:
    if os.name == "nt":  # Windows cannot open a directory; NTFS journals the rename itself
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # already failing with the real error; a leftover temp is cleaned up on resume
        logger.warning("could not remove %s", path)
