"""Output part files: one explicit schema, each part committed atomically.

A part is written under a temporary name starting with "." (pyarrow.dataset and our readers skip
such names), flushed and fsynced, renamed into place with os.replace (atomic within a directory
on POSIX), then the directory is fsynced so the rename itself survives a power cut. A reader thus
sees a complete part or nothing, and `write_part` either returns the final path or raises
OutputError and leaves no file of that part behind, so a caller may treat "raised" as "not
committed" and write those rows again.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import OutputError

logger = logging.getLogger(__name__)

# Fixed output columns, after the id column and before the passthrough input columns.
OUTPUT_FIXED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string()),  # one of FINISH_REASONS
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    pa.field("error", pa.string()),  # null when the row succeeded
)
FINISH_REASONS = ("stop", "length", "error")
TEMP_SUFFIX = ".tmp"
_SEQ_DIGITS = 5  # names sort in write order up to 99999 parts per prefix

# Tests set this to inject faults: called with "write", "fsync", "rename", "fsync_dir" before
# each stage of write_part, it may raise OSError(errno.ENOSPC, ...) and the like.
_fault_hook: Callable[[str], None] | None = None


def output_schema(id_field: pa.Field, passthrough: list[pa.Field]) -> pa.Schema:
    """The id field, then OUTPUT_FIXED_FIELDS, then the passthrough input columns in input order."""
    fields = [id_field, *OUTPUT_FIXED_FIELDS, *passthrough]
    names = [f.name for f in fields]
    # The CLI rejects colliding names with a usage error; reaching here with one is a bug.
    assert len(set(names)) == len(names), f"output column names collide: {names}"
    return pa.schema(fields)


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

    def write_part(self, rows: pa.Table | pa.RecordBatch | list[dict[str, Any]]) -> Path:
        """Write `rows` as one complete part and return its final path (see the module docstring)."""
        table = self._to_table(rows)
        name = f"{self.prefix}-{self.next_seq:0{_SEQ_DIGITS}d}-{uuid.uuid4().hex[:8]}.parquet"
        final_path = self.out_dir / name
        temp_path = self.out_dir / f".{name}{TEMP_SUFFIX}"
        renamed = False
        try:
            with open(temp_path, "xb") as file:  # "x": a name collision is a bug, never overwrite
                _stage("write")
                pq.write_table(table, file, compression=self.compression)
                _stage("fsync")
                file.flush()
                os.fsync(file.fileno())
            _stage("rename")
            os.replace(temp_path, final_path)
            renamed = True
            _stage("fsync_dir")
            _fsync_dir(self.out_dir)
        except BaseException as e:  # KeyboardInterrupt too: never leave a partial part behind
            _remove_quietly(temp_path)
            if renamed:  # not durable yet, and the caller will write these rows again
                _remove_quietly(final_path)
            if isinstance(e, OSError):
                raise OutputError(f"cannot write output part {final_path}: {e.strerror or e}") from e
            raise
        self.next_seq += 1
        return final_path

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


def check_output_dir(out_dir: str | Path) -> Path:
    """Create the output directory if missing and make sure this process can write into it."""
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


def cleanup_temp_files(out_dir: str | Path) -> int:
    """Remove temp files (".*.tmp") a crashed run left in `out_dir`; return how many."""
    path = Path(out_dir)
    if not path.is_dir():
        return 0
    num_removed = 0
    for entry in path.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX) and entry.is_file():
            entry.unlink(missing_ok=True)
            num_removed += 1
    if num_removed:
        logger.info("removed %d temp files left by an earlier run in %s", num_removed, path)
    return num_removed


def _stage(name: str) -> None:
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
