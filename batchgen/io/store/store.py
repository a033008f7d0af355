"""Where a job's output lives: a local directory or an object-store prefix, behind one small interface.

The commit protocol (batchgen.io.manifest.manifest) needs only the operations below. The two stores differ
in one property that the protocol reads, `renames`:

    LocalStore   a directory: files are written under hidden temp names, fsynced, and renamed into
                 place (atomic), directories are fsynced; `renames` is True.
    ObjectStore  an s3:// or gs:// prefix through pyarrow.fs: an object is written by one PUT, so
                 it is whole or absent, but there is no rename and no directory. A part is written
                 under its final, unique name before the manifest entry that commits it; until that
                 entry exists no reader counts it (batchgen.io.manifest.manifest). `renames` is False.

`open_store` turns what the user passed as --output into one; every io function that takes an
output directory also accepts a store, so callers that hold a local Path keep working.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import OutputError
from batchgen.io.store.local_files import fault_point, fsync_dir, write_with_atomic


class OutputStore:
    """The operations the commit protocol needs; names are relative ("part-1.parquet", "_manifest/x")."""

    renames: bool  # True: temp + rename publishes a file; False: a file is written at its final name
    url: str  # as shown to the user

    def __str__(self) -> str:
        return self.url

    def __truediv__(self, name: str) -> str:  # for messages only: "<url>/<name>"
        return f"{self.url.rstrip('/')}/{name}"

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    # -- to implement ------------------------------------------------------------------------------
    def list(self, sub: str = "") -> dict[str, int | None]:
        """{name: size in bytes (None for a directory)} directly under `sub`; {} when it does not exist."""
        raise NotImplementedError

    def is_dir(self, sub: str) -> bool:
        raise NotImplementedError

    def makedir(self, sub: str) -> None:
        raise NotImplementedError

    def read_bytes(self, name: str) -> bytes:
        raise NotImplementedError

    def place(self, name: str, write: Callable[[BinaryIO], None], *, exclusive: bool = False) -> None:
        """Write a whole file at `name` so that readers see the old one, none, or the new one
        (never a part); `exclusive` refuses to replace an existing file (OutputError)."""
        raise NotImplementedError

    def stage(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        """Write a new file at `name` (never replacing one), durable when this returns, on failure absent."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def sync(self, sub: str = "") -> None:
        """Make the names created or removed under `sub` durable (a directory fsync; nothing on a store)."""

    def open_input(self, name: str):
        """A file object for pyarrow readers."""
        raise NotImplementedError

    def lock(self):
        """The job's exclusive hold on this output: io.store.lock.OutputLock or io.store.lease.Lease."""
        raise NotImplementedError

    def holder(self) -> dict[str, Any] | None:
        """Who holds the output now (read-only), else None."""
        raise NotImplementedError

    def sub(self, name: str) -> OutputStore:
        """The store of the directory (or prefix) `name` under this one: a sharded job's shard-I-of-N/."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        sub, _, base = name.rpartition("/")
        return base in self.list(sub)

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        self.place(name, lambda file: file.write(data), exclusive=exclusive)

    def digest(self, name: str) -> tuple[int, str]:
        """(size in bytes, sha256 hex), read in bounded chunks."""
        digest = hashlib.sha256()
        num_bytes = 0
        with self.open_input(name) as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
                num_bytes += len(chunk)
        return num_bytes, digest.hexdigest()

    def read_table(self, name: str, columns: list[str] | None = None) -> pa.Table:
        with self.open_input(name) as file:
            return pq.read_table(file, columns=columns)

    def read_schema(self, name: str) -> pa.Schema:
        with self.open_input(name) as file:
            return pq.read_schema(file)


class LocalStore(OutputStore):
    renames = True

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = str(root)

    def path(self, name: str = "") -> Path:
        return self.root / name if name else self.root

    def list(self, sub: str = "") -> dict[str, int | None]:
        try:
            entries = list(os.scandir(self.path(sub)))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out: dict[str, int | None] = {}
        for entry in entries:
            try:
                out[entry.name] = None if entry.is_dir() else entry.stat().st_size
            except FileNotFoundError:  # removed while listing
                continue
        return out

    def is_dir(self, sub: str) -> bool:
        return self.path(sub).is_dir()

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def makedir(self, sub: str) -> None:
        directory = self.path(sub)
        if directory.is_dir():
            return
        try:
            directory.mkdir()
        except OSError as e:
            raise OutputError(f"cannot create {directory}: {e.strerror or e}") from e
        fsync_dir(directory.parent)

    def read_bytes(self, name: str) -> bytes:
        return self.path(name).read_bytes()

    def place(self, name: str, write: Callable[[BinaryIO], None], *, exclusive: bool = False) -> None:
        write_with_atomic(self.path(name), write, exclusive=exclusive)

    def stage(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        path = self.path(name)
        with open(path, "xb") as file:  # "x": a name collision is a bug, never overwrite
            fault_point("write")
            write(file)
            fault_point("fsync")
            file.flush()
            os.fsync(file.fileno())

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.path(src), self.path(dst))

    def delete(self, name: str) -> None:
        path = self.path(name)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise OutputError(f"cannot remove {path}: {e.strerror or e}") from e

    def sync(self, sub: str = "") -> None:
        fsync_dir(self.path(sub))

    def open_input(self, name: str):
        return open(self.path(name), "rb")

    def read_table(self, name: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.path(name), columns=columns)  # memory-mapped reads, as before

    def lock(self):
        from batchgen.io.store.lock import OutputLock

        return OutputLock(self.root)

    def holder(self) -> dict[str, Any] | None:
        from batchgen.io.store.lock import lock_holder

        return lock_holder(self.root)

    def sub(self, name: str) -> LocalStore:
        return LocalStore(self.root / name)
