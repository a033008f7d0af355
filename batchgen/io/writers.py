"""Output part files: one explicit schema, each part committed atomically.

A part is written under a temporary name starting with "." (pyarrow.dataset and our readers skip
such names), flushed and fsynced, renamed into place with os.replace (atomic within a directory
on POSIX), then the directory is fsynced so the rename itself survives a power cut. A reader thus
sees a complete part or nothing.

A job stages its parts (`stage_part`: written and fsynced under a
hidden temporary name), records them in the manifest (batchgen.io.manifest), and only then
publishes them (`publish_staged`: rename + directory fsync). The manifest is the commit point;
see batchgen.io.manifest for why and for what recovery does with the temps a crash leaves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import OutputError, UnsupportedOutputError

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
_SEQ_DIGITS = 5  # names sort in write order up to 99999 parts per prefix
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# Tests set this to inject faults: called with "write", "fsync", "rename", "fsync_dir" before
# each stage of a part's write, with "file_write", "file_fsync", "file_rename",
# "file_fsync_dir" before each stage of write_file_atomic (manifest entries, _SUCCESS), with
# "fsync_staged" before a manifest commit fsyncs the staged parts' directory, and with
# "batch_file_rename" before each OpenAI Batch file is renamed into place; it may raise
# OSError(errno.ENOSPC, ...) and the like.
_fault_hook: Callable[[str], None] | None = None


@dataclass(slots=True)
class StagedPart:
    """A part written and fsynced under its temporary name, not yet visible."""

    final_path: Path
    temp_path: Path
    num_rows: int
    num_bytes: int
    sha256: str  # hex digest of the file's bytes


class PartWriter:
    """Writes atomically committed Parquet parts `{prefix}-{seq:05d}-{uuid8}.parquet` into one dir.

    The uuid component keeps names unique across processes and resumed runs; the sequence number
    continues after the parts of this prefix already present, so names sort in write order.
    """

    def __init__(self, out_dir: str | Path, schema: pa.Schema, *, prefix: str = "part",
                 compression: str = "zstd"):
        self.out_dir = Path(out_dir)
        self.schema = schema
        self.prefix = prefix
        self.compression = compression
        self.next_seq = _next_seq(self.out_dir, prefix)

    def new_name(self) -> str:
        """The next unused part name; names sort in the order they were handed out."""
        name = f"{self.prefix}-{self.next_seq:0{_SEQ_DIGITS}d}-{uuid.uuid4().hex[:8]}.parquet"
        self.next_seq += 1
        return name

    def stage_part(self, rows: pa.Table | pa.RecordBatch | list[dict[str, Any]], *, name: str | None = None,
                   tag: str = "") -> StagedPart:
        """Write `rows` under the hidden name `.{name}{tag}.tmp`, fsynced, and return what it wrote.

        `name` defaults to a new one; an existing part's name stages its replacement. On any
        failure the temp file is removed and OSError becomes OutputError.
        """
        table = self._to_table(rows)
        staged = self._stage(lambda file: pq.write_table(table, file, compression=self.compression), name, tag)
        staged.num_rows = table.num_rows
        return staged

    def stage_tables(self, tables: Iterable[pa.Table], *, name: str | None = None, tag: str = "") -> StagedPart:
        """stage_part for rows that arrive in pieces (bounded memory): one part, one row group per piece."""
        num_rows = 0

        def write(file) -> None:
            nonlocal num_rows
            with pq.ParquetWriter(file, self.schema, compression=self.compression) as parquet:
                for table in tables:
                    parquet.write_table(self._to_table(table))
                    num_rows += table.num_rows

        staged = self._stage(write, name, tag)
        staged.num_rows = num_rows
        return staged

    def _stage(self, write: Callable[[Any], None], name: str | None, tag: str) -> StagedPart:
        name = name or self.new_name()
        final_path = self.out_dir / name
        temp_path = self.out_dir / f".{name}{tag}{TEMP_SUFFIX}"
        try:
            with open(temp_path, "xb") as file:  # "x": a name collision is a bug, never overwrite
                fault_point("write")
                write(file)
                fault_point("fsync")
                file.flush()
                os.fsync(file.fileno())
            num_bytes, sha256 = file_digest(temp_path)
        except BaseException as e:  # KeyboardInterrupt too: never leave a partial part behind
            _remove_quietly(temp_path)
            if isinstance(e, OSError):
                raise OutputError(f"cannot write output part {final_path}: {e.strerror or e}") from e
            raise
        return StagedPart(final_path, temp_path, 0, num_bytes, sha256)

    def _to_table(self, rows: pa.Table | pa.RecordBatch | list[dict[str, Any]]) -> pa.Table:
        """Cast to the explicit schema, never infer; a dict may omit a key to mean null."""
        names = self.schema.names
        if isinstance(rows, list):
            unknown = set().union(*(row.keys() for row in rows)) - set(names)
            if unknown:
                raise ValueError(f"rows have columns not in the output schema: {sorted(unknown)}")
            return pa.Table.from_pylist(rows, schema=self.schema)
        if isinstance(rows, pa.RecordBatch):
            rows = pa.Table.from_batches([rows])
        if set(rows.column_names) != set(names):
            raise ValueError(f"columns {rows.column_names} do not match the output schema {names}")
        return rows.select(names).cast(self.schema)


def refuse_url_output(out_dir: str | Path) -> None:
    """An output URL would otherwise become a local directory named "s3:": refuse it (exit 2).

    The commit protocol needs rename and directory fsync, which object stores do not have; object
    store output needs its own commit (a later issue), not this one pointed at a bucket.
    """
    text = str(out_dir)
    if _URL_RE.match(text):
        raise UnsupportedOutputError(f"--output {text}: writing to a URL ({text.split('://')[0]}://) is not "
                                     "supported yet; write to a local or mounted directory and copy it after "
                                     "_SUCCESS")


def check_output_dir(out_dir: str | Path) -> Path:
    """Create the output directory if missing and make sure this process can write into it."""
    refuse_url_output(out_dir)
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise OutputError(f"output path exists and is not a directory: {path}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output directory {path}: {e.strerror or e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"output directory is not writable: {path}")
    # os.access trusts permission bits; a read-only mount or a root-squashing NFS server only
    # shows itself when a file is actually created.
    probe = path / f".write-probe-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as e:
        raise OutputError(f"output directory is not writable: {path}: {e.strerror or e}") from e
    return path


def publish_staged(staged: list[StagedPart], *, durable: bool = True) -> None:
    """Rename staged parts to their final names (in the order given), then fsync the directory.

    os.replace is atomic, so a reader sees each part whole or not at all; an existing final name
    (a part being rewritten) is swapped in one step. OSError becomes OutputError; nothing is
    removed, because a job calls this only after the manifest committed these parts. A job skips
    the directory fsync (`durable=False`): a rename lost in a power cut leaves the temp, which
    recovery publishes again.
    """
    try:
        for part in staged:
            fault_point("rename")
            os.replace(part.temp_path, part.final_path)
        if not durable:
            return
        fault_point("fsync_dir")
        for directory in {part.final_path.parent for part in staged}:
            _fsync_dir(directory)
    except OSError as e:
        raise OutputError(f"cannot publish output part {part.final_path}: {e.strerror or e}") from e


def write_file_atomic(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write `data` to `path` so that a crash leaves the old file, or no file, or the new one.

    Temp file in the same directory, fsync, rename, directory fsync. `exclusive` refuses to
    replace an existing file (a hard link instead of a rename: put-if-absent), which keeps a
    second writer that got past the lock from silently overwriting a manifest entry.
    """
    temp_path = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    placed = False
    try:
        with open(temp_path, "xb") as file:
            fault_point("file_write")
            file.write(data)
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
        _remove_quietly(temp_path)
        if isinstance(e, FileExistsError):
            raise OutputError(f"{path} appeared while this job was writing it: another process is "
                              "writing to this output directory") from e
        if isinstance(e, OSError):
            if placed:  # renamed but maybe not durable: undo, so "raised" means "not written"
                _remove_quietly(path)
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from e
        raise


def write_json_atomic(path: Path, obj: Any, *, exclusive: bool = False) -> None:
    write_file_atomic(path, (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode(),
                      exclusive=exclusive)


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
    try:
        os.link(temp_path, path)  # fails with FileExistsError if `path` exists
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: the lock alone keeps writers apart
        os.replace(temp_path, path)
        return
    os.unlink(temp_path)


def fault_point(name: str) -> None:
    """Where a test's _fault_hook may inject a failure (see above)."""
    if _fault_hook is not None:
        _fault_hook(name)


def _next_seq(out_dir: Path, prefix: str) -> int:
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]{{8}}\.parquet")
    try:
        names = os.listdir(out_dir)
    except (FileNotFoundError, NotADirectoryError):  # check_output_dir reports a file in the way
        return 0
    seqs = [int(m.group(1)) for name in names if (m := pattern.fullmatch(name))]
    return max(seqs, default=-1) + 1


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
