"""Output part files: one explicit schema, each part committed atomically.

A part is written under a temporary name starting with "." (pyarrow.dataset and our readers skip
such names), flushed and fsynced, renamed into place with os.replace (atomic within a directory
on POSIX), then the directory is fsynced so the rename itself survives a power cut. A reader thus
sees a complete part or nothing.

A job stages its parts (`stage_part`: written and fsynced under a
hidden temporary name), records them in the manifest (batchgen.io.manifest.manifest), and only then
publishes them (`publish_staged`: rename + directory fsync). The manifest is the commit point;
see batchgen.io.manifest.manifest for why and for what recovery does with the temps a crash leaves.

Files go through the output's store (batchgen.io.store.store): in an object store, which has no rename,
a part is staged under its final, unique name (one PUT) and publishing it is a no-op.
"""

from __future__ import annotations

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

from batchgen.errors import OutputError
from batchgen.io.store.factory import open_store
from batchgen.io.store.local_files import (
    TEMP_SUFFIX,
    fault_point,
    write_file_atomic,
)
from batchgen.io.store.store import LocalStore, OutputStore

logger = logging.getLogger(__name__)

_SEQ_DIGITS = 5  # names sort in write order up to 99999 parts per prefix
# rows per Parquet row group of a part: what `batchgen compact` holds of a part at a time
# (batchgen.jobs.commands.compact), so a part of any --rows-per-part is never read whole into memory
ROW_GROUP_ROWS = 4096



@dataclass(slots=True)
class StagedPart:
    """A part written and durable under its temporary name, not yet committed.

    In a local directory the temp is a hidden name that a rename publishes; in an object store
    (no rename) the temp is the final, unique name itself, and the manifest entry alone commits it.
    """

    store: OutputStore
    name: str  # final
    temp: str  # as staged; == name in an object store
    num_rows: int
    num_bytes: int
    sha256: str  # hex digest of the file's bytes

    @property
    def final_path(self) -> Path:  # local stores only (tests, messages)
        return self.store.path(self.name)

    @property
    def temp_path(self) -> Path:
        return self.store.path(self.temp)

    @property
    def published(self) -> bool:
        return self.temp == self.name

    def discard(self) -> None:
        """Remove the staged file of a part that will not be committed."""
        try:
            self.store.delete(self.temp)
        except OutputError:
            logger.warning("could not remove %s", self.store / self.temp)


class PartWriter:
    """Writes atomically committed Parquet parts `{prefix}-{seq:05d}-{uuid8}.parquet` into one dir.

    The uuid component keeps names unique across processes and resumed runs; the sequence number
    continues after the parts of this prefix already present, so names sort in write order.
    """

    def __init__(self, out_dir: str | Path | OutputStore, schema: pa.Schema, *, prefix: str = "part",
                 compression: str = "zstd"):
        self.store = open_store(out_dir)
        self.out_dir = self.store.path() if isinstance(self.store, LocalStore) else self.store
        self.schema = schema
        self.prefix = prefix
        self.compression = compression
        self.next_seq = _next_seq(self.store, prefix)

    def new_name(self) -> str:
        """The next unused part name; names sort in the order they were handed out."""
        name = f"{self.prefix}-{self.next_seq:0{_SEQ_DIGITS}d}-{uuid.uuid4().hex[:8]}.parquet"
        self.next_seq += 1
        return name

    def stage_part(self, rows: pa.Table | pa.RecordBatch | list[dict[str, Any]], *, name: str | None = None,
                   tag: str = "") -> StagedPart:
        """Write `rows` under the hidden name `.{name}{tag}.tmp`, fsynced, and return what it wrote.

        `name` defaults to a new one; an existing part's name stages its replacement (in an object
        store, which cannot replace a part atomically, the replacement gets a new name: the caller
        removes the old one in the same commit). On any failure the temp file is removed and
        OSError becomes OutputError.
        """
        table = self._to_table(rows)
        staged = self._stage(lambda file: pq.write_table(table, file, compression=self.compression,
                                                         row_group_size=ROW_GROUP_ROWS), name, tag)
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
        store = self.store
        if name is None or not store.renames:
            name = self.new_name()  # an object store writes every version of a part under a new name
        temp = f".{name}{tag}{TEMP_SUFFIX}" if store.renames else name
        staged = StagedPart(store, name, temp, 0, 0, "")
        try:
            store.stage(temp, write)
            staged.num_bytes, staged.sha256 = store.digest(temp)
        except BaseException as e:  # KeyboardInterrupt too: never leave a partial part behind
            staged.discard()
            if isinstance(e, OSError):
                raise OutputError(f"cannot write output part {store / name}: {e.strerror or e}") from e
            raise
        return staged

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


def check_output_dir(out_dir: str | Path | OutputStore) -> Path | OutputStore:
    """Create the output directory if missing and make sure this process can write into it."""
    store = open_store(out_dir)
    if not isinstance(store, LocalStore):
        probe = f".write-probe-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
        store.write_bytes(probe, b"")  # credentials, bucket and permissions fail here, before any work
        store.delete(probe)
        return store
    path = store.path()
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
    staged = [part for part in staged if not part.published]  # an object store's parts need no step
    try:
        for part in staged:
            fault_point("rename")
            part.store.rename(part.temp, part.name)
        if not durable or not staged:
            return
        fault_point("fsync_dir")
        for store in {id(part.store): part.store for part in staged}.values():
            store.sync()
    except OSError as e:
        raise OutputError(f"cannot publish output part {part.store / part.name}: {e.strerror or e}") from e


def write_json_atomic(path: Path | tuple[OutputStore, str], obj: Any, *, exclusive: bool = False) -> None:
    """`path`, or (store, name): the whole file or nothing, as write_file_atomic."""
    data = json_bytes(obj)
    if isinstance(path, tuple):
        store, name = path
        store.write_bytes(name, data, exclusive=exclusive)
    else:
        write_file_atomic(path, data, exclusive=exclusive)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def _next_seq(store: OutputStore, prefix: str) -> int:
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]{{8}}\.parquet")
    names = store.list()  # {} when missing; check_output_dir reports a file in the way
    seqs = [int(m.group(1)) for name in names if (m := pattern.fullmatch(name))]
    return max(seqs, default=-1) + 1
