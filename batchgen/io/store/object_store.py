"""Object-store output: an s3:// or gs:// prefix through pyarrow.fs (batchgen.io.store.store describes the interface).

An object is written with one PUT, so it is whole or absent, but there is no rename, no directory
and no fsync: the commit protocol (batchgen.io.manifest.manifest) writes a part under its final, unique name
before the manifest entry that commits it, and the job holds a lease (batchgen.io.store.lease) instead of
a lock.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.config.output_url import URL_RE, check_object_url
from batchgen.errors import AlreadyExists, OutputError, UnsupportedOutputError
from batchgen.io.store.conditional_put import ConditionalPut, PreconditionFailed, conditional_put_for
from batchgen.io.store.lease import Lease, lease_holder, lease_ttl_s
from batchgen.io.store.local_files import TEMP_SUFFIX
from batchgen.io.store.store import OutputStore

# Every request must end well inside the lease (batchgen.io.store.lease): a commit is refused once less
# than LEASE_MARGIN of it remains, so a request may take at most a sixth of the TTL (10 s of 60 s).
S3_REQUEST_TIMEOUT_S = 10.0
S3_CONNECT_TIMEOUT_S = 5.0
MIN_REQUEST_TIMEOUT_S = 1.0
UNSAFE_STORE_ENV = "BATCHGEN_UNSAFE_STORE"  # "1": write to a store that ignores conditional writes (unfenced)

log = logging.getLogger(__name__)

# what each store (endpoint, bucket) answered to the probe in this process: None, or the header it ignored
_PROBED: dict[tuple[str, str], str | None] = {}


def request_timeouts(ttl_s: float) -> tuple[float, float]:
    """(connect, request) timeouts in seconds for a job whose lease lasts `ttl_s`."""
    request = max(min(S3_REQUEST_TIMEOUT_S, ttl_s / 6), MIN_REQUEST_TIMEOUT_S)
    return min(S3_CONNECT_TIMEOUT_S, request), request


class ObjectStore(OutputStore):
    """An object-store prefix through pyarrow.fs. Objects are written with one PUT each (buffered
    in memory: a part is at most --rows-per-part rows), so a failed write leaves nothing."""

    renames = False

    def __init__(self, fs: pafs.FileSystem, base: str, url: str, conditional: ConditionalPut):
        self.fs = fs
        self.base = base.rstrip("/")
        self.url = url.rstrip("/")
        self.conditional = conditional  # the SDK's conditional writes (batchgen.io.store.conditional_put)

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
        if not exclusive:
            self._put(name, write)
            return
        buffer = io.BytesIO()  # exclusive: one conditional PUT through the SDK (If-None-Match: *)
        write(buffer)
        self.create(name, buffer.getvalue())

    def create(self, name: str, data: bytes) -> str:
        """Write `name` only if no object has it (AlreadyExists otherwise); its version token."""
        from batchgen.io.store.local_files import fault_point

        fault_point("write")
        try:
            return self.conditional.put(self._key(name), data, if_absent=True)
        except PreconditionFailed:
            raise AlreadyExists(f"{self / name} appeared while this job was writing it: another process is "
                                "writing to this output") from None

    def read_versioned(self, name: str) -> tuple[bytes, str]:
        """(data, version token) of `name` in one GET; FileNotFoundError when absent."""
        return self.conditional.read(self._key(name))

    def replace_if(self, name: str, data: bytes, version: str) -> str | None:
        """Replace `name` only if it is still at `version`; its new token, or None if it changed."""
        try:
            return self.conditional.put(self._key(name), data, if_version=version)
        except PreconditionFailed:
            return None

    def check_conditional_writes(self) -> None:
        """Refuse (UnsupportedOutputError, exit 2) a store that ignores conditional writes, unless
        UNSAFE_STORE_ENV is "1"; asked once per store and process, by every lease (batchgen.io.store.lease).

        Fencing rests on them: an S3-compatible server that accepts If-None-Match / If-Match and
        ignores them (older MinIO, Ceph and appliance releases) lets a job that stalled past its lease
        replace the next holder's manifest entry and its rows vanish from the manifest, and lets two
        jobs racing for the lease both win."""
        where = (self.conditional.where, self.base.split("/", 1)[0])
        if where not in _PROBED:
            try:
                _PROBED[where] = self._probe()
            except OutputError as e:  # a server that rejects the headers (501), credentials, the network
                raise OutputError(f"--output {self.url}: cannot check that the store honours conditional writes "
                                  f"(If-None-Match / If-Match), which fence a job that stalled past its lease: "
                                  f"{e}") from e
        ignored = _PROBED[where]
        if ignored is None:
            return
        why = (f"--output {self.url}: the store ignored {ignored} (a conditional PUT that must fail landed), so it "
               "cannot fence a job that stalled past its lease: that job's late manifest entry could replace the "
               "next job's, and that job's rows would vanish from the manifest")
        if os.environ.get(UNSAFE_STORE_ENV) == "1":
            log.warning("%s does not honour conditional writes; writing anyway (%s=1): %s", self.url,
                        UNSAFE_STORE_ENV, why)
            return
        raise UnsupportedOutputError(f"{why}. Use a store that honours If-None-Match and If-Match (AWS S3, GCS, a "
                                     f"recent MinIO), or set {UNSAFE_STORE_ENV}=1 to write without that protection, "
                                     "only where no two jobs can ever write this output")

    def _probe(self) -> str | None:
        """Which conditional header the store ignores, or None: a new key PUT twice if absent, then
        replaced at its version, then replaced again at that now stale version."""
        name = f".fencing-probe-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"  # a hidden temp: recovery deletes a leftover
        key = self._key(name)
        put = self.conditional.put
        try:
            first = put(key, b"1", if_absent=True)
            try:
                put(key, b"2", if_absent=True)
                return "If-None-Match: *"
            except PreconditionFailed:
                pass
            try:
                put(key, b"3", if_version=first)
            except PreconditionFailed:
                return "If-Match (it refused the current version)"
            try:
                put(key, b"4", if_version=first)
                return "If-Match"
            except PreconditionFailed:
                return None
        finally:
            self.delete(name)

    def stage(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        self._put(name, write)

    def _put(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        from batchgen.io.store.local_files import fault_point

        buffer = io.BytesIO()
        fault_point("write")
        write(buffer)
        try:
            with self.fs.open_output_stream(self._key(name)) as out:  # one object, visible on close
                out.write(buffer.getbuffer())
        except OSError as e:
            raise OutputError(f"cannot write {self / name}: {e}") from e

    @contextmanager
    def open_stream(self, name: str) -> Iterator[Any]:
        """A new object at `name`, written through the block as a stream (a multipart upload: a file of
        any size, never held whole in memory), visible whole when the block ends. A kill before then
        leaves no object (an upload that is never completed is not one; a bucket lifecycle rule
        removes its parts). pyarrow cannot abort an upload, so an error in the block completes it
        and the partial object is deleted at once: a caller that needs "whole or absent" across a
        failure keeps a marker of its own (the OpenAI Batch files: _SUCCESS)."""
        from batchgen.io.store.local_files import fault_point

        try:
            out = self.fs.open_output_stream(self._key(name))
        except OSError as e:
            raise OutputError(f"cannot write {self / name}: {e}") from e
        try:
            yield out
            fault_point("stream_close")
        except BaseException:
            self._close_and_delete(out, name)
            raise
        try:
            out.close()
        except OSError as e:
            self._close_and_delete(out, name)
            raise OutputError(f"cannot write {self / name}: {e}") from e

    def _close_and_delete(self, out: Any, name: str) -> None:
        try:
            out.close()
        except OSError:
            pass
        try:
            self.delete(name)
        except OutputError:
            pass  # best effort: the caller's own marker says the object is not to be read

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
        return Lease(self)

    def holder(self) -> dict[str, Any] | None:
        return lease_holder(self)

    def sub(self, name: str) -> ObjectStore:
        return ObjectStore(self.fs, self._key(name), f"{self.url}/{name}", self.conditional)  # the same connection


def _not_found(e: OSError) -> bool:
    return "NoSuchKey" in str(e) or "not found" in str(e).lower() or "does not exist" in str(e)


def open_object_store(url: str) -> ObjectStore:
    """The store for an s3:// or gs:// output URL."""
    check_object_url(url)
    text = url.rstrip("/")
    scheme = URL_RE.match(text).group(1).lower()
    connect_s, request_s = request_timeouts(lease_ttl_s())
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    conditional = conditional_put_for(scheme, text, endpoint=endpoint, region=region, connect_timeout_s=connect_s,
                                      request_timeout_s=request_s)
    try:
        if scheme == "s3":
            fs, base = _s3_filesystem(text, connect_s, request_s)
        else:
            fs, base = pafs.FileSystem.from_uri(text)
    except (OSError, ValueError, pa.ArrowInvalid) as e:
        raise OutputError(f"--output {text}: cannot open the object store: {e}") from e
    return ObjectStore(fs, base, text, conditional)


def _s3_filesystem(url: str, connect_s: float, request_s: float) -> tuple[pafs.FileSystem, str]:
    """S3 with the standard AWS environment: credentials through the AWS SDK's own chain
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, instance roles), the
    region from AWS_REGION / AWS_DEFAULT_REGION (else asked of the bucket), and AWS_ENDPOINT_URL_S3
    or AWS_ENDPOINT_URL for an S3-compatible server (MinIO, Ceph, moto).

    The request timeout (request_timeouts) is raised from the SDK's 3 s, for a busy machine or a
    slow link, but kept well under the lease's TTL: a request that outlives the lease could land
    after another job took the output over."""
    base = url.split("://", 1)[1]
    bucket = base.split("/", 1)[0]
    options: dict[str, Any] = {"request_timeout": request_s, "connect_timeout": connect_s}
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
