"""Trust in a cached kernel: a shared object is loaded only if this user built it and nobody else can change it.

Loading a `.so` runs its code in this process, and the cache may sit in a directory others can
write (a shared $XDG_CACHE_HOME, a team's BATCHGEN_CACHE_DIR). So a build publishes, next to each
`<name>.so`, `<name>.so.sha256` holding the digest of the bytes it built, both files made
read-only to group and others; and before a cached file is loaded, `problem` checks that it is a
regular file (no symlink) owned by the current user, writable by no group or other user, and that
its sha256 matches the recorded one (whose file passes the same ownership checks). A file that
fails is built again (batchgen.engine.kernels.native), never loaded.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

SUFFIX = ".sha256"


def digest_path(target: Path) -> Path:
    return target.with_name(target.name + SUFFIX)


def problem(target: Path) -> str | None:
    """Why the cached `target` must not be loaded; None when it may be."""
    for path in (target, digest_path(target)):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return f"{path.name} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{path.name} is not a regular file"
        if info.st_uid != os.geteuid():
            return f"{path.name} is owned by uid {info.st_uid}, not by this user"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path.name} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    recorded = digest_path(target).read_text().strip()
    if sha256(target) != recorded:
        return f"{target.name} does not match the sha256 its build recorded"
    return None


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
