"""What the lock of a local output (batchgen.io.store.lock) and the lease of an object-store output
(batchgen.io.store.lease) share: a claim on an output by one job, the holder record each stores (pid,
host, start time), whether that holder still runs, and the message that refuses a second job."""

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
    """This process as the holder ("pid", "host", "started": unix time), first in what a lock file or
    a lease stores."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": started}


def in_use_message(output: object, details: str) -> str:
    """The refusal of a second job on `output`; `details` (who holds it) follows the job's name."""
    return (f"{output} is in use by another batchgen job{details}; wait for it to finish, stop it, "
            "or choose another --output")


def holder_is_dead(holder: dict) -> bool:
    """Only a pid on this host can be checked; a holder on another host is presumed live."""
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
