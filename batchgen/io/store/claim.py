"""What the lock of a local output (batchgen.io.store.lock) and the lease of an object-store output
(batchgen.io.store.lease) share: a claim on an output by one job, the holder record each stores, whether
that holder still runs, and the message that refuses a second job.

A holder is more than host + pid: containers run with `--network host` share the host name but
not the pid namespace, so a pid that does not exist here may be a live job next door. The record
also carries the kernel's boot id (/proc/sys/kernel/random/boot_id), the pid namespace
(/proc/self/ns/pid) and the process's start time (/proc/PID/stat, which tells a reused pid
apart). A holder is judged dead only when every one of these says so: same host, same boot, same
pid namespace, and its pid gone, a zombie, or started at another time. Anything else (another
host, a record without these fields, a platform without /proc) is presumed live.
"""

from __future__ import annotations

import os
import socket
from typing import Any, TypeVar

Claim = TypeVar("Claim", bound="OutputClaim")


class OutputClaim:
    """`with claim:` = acquire(), and release() on the way out however the block ends."""

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self: Claim) -> Claim:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder_record(started: float) -> dict[str, Any]:
    """This process as the holder ("pid", "host", "started": unix time, and the identity fields of
    the module docstring), first in what a lock file or a lease stores."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "started": started, "boot_id": boot_id(),
            "pid_ns": pid_namespace(), "pid_start": process_start(pid)}


def boot_id() -> str | None:
    """This kernel's boot id (Linux), else None."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace ("pid:[inode]", Linux), else None."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_kernel_and_namespace(holder: dict) -> bool:
    """Whether `holder` ran under this kernel and in this pid namespace, so its pid means what it means here."""
    if holder.get("host") != socket.gethostname():
        return False
    here_boot, here_ns = boot_id(), pid_namespace()
    return (here_boot is not None and here_ns is not None and holder.get("boot_id") == here_boot
            and holder.get("pid_ns") == here_ns)


def in_use_message(output: object, details: str) -> str:
    """The refusal of a second job on `output`; `details` (who holds it) follows the job's name."""
    return (f"{output} is in use by another batchgen job{details}; wait for it to finish, stop it, "
            "or choose another --output")


def holder_is_dead(holder: dict) -> bool:
    """True only when every part of the holder's identity shows it gone (the module docstring)."""
    if not same_kernel_and_namespace(holder):
        return False  # another host, container or boot, or an old record: cannot be checked from here
    try:
        pid = int(holder["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, ValueError, TypeError):
        return False
    start = process_start(pid)
    if start is not None and holder.get("pid_start") is not None and start != holder["pid_start"]:
        return True  # the pid was reused by a process started later
    try:  # a killed process stays a zombie until its parent reaps it: dead all the same
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
