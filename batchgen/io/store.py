"""Where a job's output lives: a local directory or an object-store prefix, behind one small interface.

The commit protocol (batchgen.io.manifest) needs only the operations below. The two stores differ
in one property that the protocol reads, `renames`:

    LocalStore   a directory: files are written under hidden temp names, fsynced, and renamed into
                 place (atomic), directories are fsynced; `renames` is True.
    ObjectStore  an s3:// or gs:// prefix through pyarrow.fs: an object is written by one PUT, so
                 it is whole or absent, but there is no rename and no directory. A part is written
                 under its final, unique name before the manifest entry that commits it; until that
                 entry exists no reader counts it (batchgen.io.manifest). `renames` is False.

`open_store` turns what the user passed as --output into one; every io function that takes an
output directory also accepts a store, so callers that hold a local Path keep working.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchgen.errors import OutputError, UnsupportedOutputError

URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_SCHEMES = ("s3", "gs")  # object stores pyarrow.fs reaches; gs only where pyarrow has GcsFileSystem
S3_REQUEST_TIMEOUT_S = 60.0
S3_CONNECT_TIMEOUT_S = 10.0


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
        """The job's exclusive hold on this output: batchgen.io.lock.OutputLock or batchgen.io.lease.Lease."""
        raise NotImplementedError

    def holder(self) -> dict[str, Any] | None:
        """Who holds the output now (read-only), else None."""
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
        from batchgen.io.writers import fsync_dir

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
        from batchgen.io.writers import write_with_atomic

        write_with_atomic(self.path(name), write, exclusive=exclusive)

    def stage(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        from batchgen.io.writers import fault_point

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
        from batchgen.io.writers import fsync_dir

        fsync_dir(self.path(sub))

    def open_input(self, name: str):
        return open(self.path(name), "rb")

    def read_table(self, name: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.path(name), columns=columns)  # memory-mapped reads, as before

    def lock(self):
        from batchgen.io.lock import OutputLock

        return OutputLock(self.root)

    def holder(self) -> dict[str, Any] | None:
        from batchgen.io.lock import lock_holder

        return lock_holder(self.root)


class ObjectStore(OutputStore):
    """An object-store prefix through pyarrow.fs. Objects are written with one PUT each (buffered
    in memory: a part is at most --rows-per-part rows), so a failed write leaves nothing."""

    renames = False

    def __init__(self, fs: pafs.FileSystem, base: str, url: str):
        self.fs = fs
        self.base = base.rstrip("/")
        self.url = url.rstrip("/")

    def _key(self, name: str) -> str:
        return f"{self.base}/{name}" if name else self.base

    def list(self, sub: str = "") -> dict[str, int | None]:
        selector = pafs.FileSelector(self._key(sub), allow_not_found=True, recursive=False)
        try:
            infos = self.fs.get_file_info(selector)
        except OSError as e:
            raise OutputError(f"cannot list {self / sub}: {e}") from e
        return {info.base_name: (None if info.type == pafs.FileType.Directory else info.size) for info in infos}

    def is_dir(self, sub: str) -> bool:
        return bool(self.list(sub))  # a prefix exists while an object is under it

    def exists(self, name: str) -> bool:
        try:
            return self.fs.get_file_info(self._key(name)).type == pafs.FileType.File
        except OSError as e:
            raise OutputError(f"cannot read {self / name}: {e}") from e

    def makedir(self, sub: str) -> None:
        pass  # prefixes need no creating

    def read_bytes(self, name: str) -> bytes:
        try:
            with self.fs.open_input_stream(self._key(name)) as file:
                return file.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            if _not_found(e):
                raise FileNotFoundError(errno.ENOENT, str(e), self / name) from e
            raise

    def place(self, name: str, write: Callable[[BinaryIO], None], *, exclusive: bool = False) -> None:
        if exclusive and self.exists(name):
            # no conditional PUT through pyarrow.fs: the lease keeps writers apart, this catches a bug
            raise OutputError(f"{self / name} appeared while this job was writing it: another process is "
                              "writing to this output")
        self._put(name, write)

    def stage(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        self._put(name, write)

    def _put(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        from batchgen.io.writers import fault_point

        buffer = io.BytesIO()
        fault_point("write")
        write(buffer)
        try:
            with self.fs.open_output_stream(self._key(name)) as out:  # one object, visible on close
                out.write(buffer.getbuffer())
        except OSError as e:
            raise OutputError(f"cannot write {self / name}: {e}") from e

    def rename(self, src: str, dst: str) -> None:
        raise AssertionError("an object store has no rename: the commit protocol never asks for one there")

    def delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self._key(name))
        except FileNotFoundError:
            pass
        except OSError as e:
            if not _not_found(e):
                raise OutputError(f"cannot remove {self / name}: {e}") from e

    def open_input(self, name: str):
        return self.fs.open_input_file(self._key(name))

    def lock(self):
        from batchgen.io.lease import Lease

        return Lease(self)

    def holder(self) -> dict[str, Any] | None:
        from batchgen.io.lease import lease_holder

        return lease_holder(self)


def _not_found(e: OSError) -> bool:
    return "NoSuchKey" in str(e) or "not found" in str(e).lower() or "does not exist" in str(e)


def is_url(text: str | Path) -> bool:
    return isinstance(text, str) and URL_RE.match(text) is not None


def check_output_url(text: str) -> None:
    """Refuse an output URL that no object store here can write (exit 2); a local path passes."""
    m = URL_RE.match(str(text))
    if m is None:
        return
    scheme = m.group(1).lower()
    if scheme == "gs" and not hasattr(pafs, "GcsFileSystem"):
        raise UnsupportedOutputError(f"--output {text}: this pyarrow was built without Google Cloud Storage "
                                     "support; write to s3://, a local or a mounted directory")
    if scheme not in OBJECT_SCHEMES:
        raise UnsupportedOutputError(f"--output {text}: writing to a {scheme}:// URL is not supported; use "
                                     "s3://bucket/prefix, gs://bucket/prefix, or a local or mounted directory")
    bucket_and_prefix = text[m.end():].strip("/")
    if "/" not in bucket_and_prefix or not bucket_and_prefix.split("/", 1)[1]:
        raise UnsupportedOutputError(f"--output {text}: give a prefix inside the bucket "
                                     f"({scheme}://BUCKET/PREFIX): a job's output never takes a whole bucket")


def open_store(out: str | Path | OutputStore) -> OutputStore:
    """The store for an --output value: a store as is, a URL through pyarrow.fs, else a local directory."""
    if isinstance(out, OutputStore):
        return out
    if not is_url(out):
        return LocalStore(out)
    check_output_url(str(out))
    text = str(out).rstrip("/")
    scheme = URL_RE.match(text).group(1).lower()
    try:
        if scheme == "s3":
            fs, base = _s3_filesystem(text)
        else:
            fs, base = pafs.FileSystem.from_uri(text)
    except (OSError, ValueError, pa.ArrowInvalid) as e:
        raise OutputError(f"--output {text}: cannot open the object store: {e}") from e
    return ObjectStore(fs, base, text)


def _s3_filesystem(url: str) -> tuple[pafs.FileSystem, str]:
    """S3 with the standard AWS environment: credentials through the AWS SDK's own chain
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, instance roles), the
    region from AWS_REGION / AWS_DEFAULT_REGION (else asked of the bucket), and AWS_ENDPOINT_URL_S3
    or AWS_ENDPOINT_URL for an S3-compatible server (MinIO, Ceph, moto).

    The request timeout is raised from the SDK's 3 s: a commit is a few requests, and a job on a
    busy machine or a slow link should wait for them rather than fail."""
    base = url.split("://", 1)[1]
    bucket = base.split("/", 1)[0]
    options: dict[str, Any] = {"request_timeout": S3_REQUEST_TIMEOUT_S, "connect_timeout": S3_CONNECT_TIMEOUT_S}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        if not host:
            scheme, host = "https", endpoint
        options.update(endpoint_override=host.rstrip("/"), scheme=scheme)
    elif not region:
        region = pafs.resolve_s3_region(bucket)
    return pafs.S3FileSystem(region=region or "us-east-1", **options), base
