"""`<output>/_metrics/`: records in small closed Parquet segments, merged as they accumulate.

A kill -9 must leave readable figures, and a Parquet file is readable only once its footer is
written, so nothing is kept open: each flush writes the records gathered since the last one as a
new segment (temp name, fsync, rename), `<kind>-<first>-<last>.parquet` with first = last = its
sequence number. Every MERGE_SEGMENTS segments of a kind are merged into one file named by the
range they cover; the small ones are deleted after the merged one is in place, and a reader
skips any file whose range lies inside another's, so a kill between the two steps shows no record
twice. Files therefore stay bounded: a segment holds at most one flush interval of records, a
merged file MERGE_SEGMENTS of them, and a day-long job at the default 10 s keeps about 150 files
per kind.

An unreadable file (a crash mid-write on a filesystem that reorders the rename before the data)
is skipped with a warning: the metrics are for people, never for the output's correctness.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.monitor.records import SCHEMAS

log = logging.getLogger("batchgen")

METRICS_DIR = "_metrics"
MERGE_SEGMENTS = 60
FILE_RE = re.compile(r"(?P<kind>[a-z]+)-(?P<first>\d{8})-(?P<last>\d{8})\.parquet")
TEMP_SUFFIX = ".tmp"
# columns under the name files written by an earlier batchgen gave them: the planning window's was
# "shard" (before the word was left to --num-shards). A resumed job's directory holds both kinds
# of segment, and its merges read the old ones too, so every reader goes through _read_segment.
OLD_NAMES = {"window": "shard"}


@dataclass(frozen=True, slots=True)
class Segment:
    kind: str
    first: int
    last: int
    path: Path


def metrics_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / METRICS_DIR


def list_segments(directory: Path, kind: str) -> list[Segment]:
    """The files of `kind` a reader should read: those no other file's range covers, by sequence."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = FILE_RE.fullmatch(name)
        if m and m["kind"] == kind:
            found.append(Segment(kind, int(m["first"]), int(m["last"]), directory / name))
    found.sort(key=lambda s: (s.first, -s.last))
    out: list[Segment] = []
    for seg in found:
        if out and seg.last <= out[-1].last:  # inside the range of a merged file read already
            continue
        out.append(seg)
    return out


def read_kind(directory: Path, kind: str, columns: list[str] | None = None,
              segments: list[Segment] | None = None) -> pa.Table:
    """Every record of `kind` (empty table if none), in the order written."""
    schema = SCHEMAS[kind]
    tables = []
    for seg in list_segments(directory, kind) if segments is None else segments:
        try:
            tables.append(_read_segment(seg.path, schema, columns))
        except FileNotFoundError:
            continue  # merged away since it was listed
        except (OSError, pa.ArrowException) as e:
            log.warning("skipping unreadable metrics file %s: %s", seg.path, e)
    if not tables:
        empty = schema if columns is None else pa.schema([schema.field(c) for c in columns])
        return empty.empty_table()
    return pa.concat_tables(tables)


def _read_segment(path: Path, schema: pa.Schema, columns: list[str] | None) -> pa.Table:
    """One file's records under `schema` (columns it lacks are null), renamed columns found under
    their old names."""
    wanted = schema.names if columns is None else columns
    renamed = [name for name in wanted if name in OLD_NAMES]
    if renamed:
        written = set(pq.read_schema(path).names)
        old = {name: OLD_NAMES[name] for name in renamed if name not in written and OLD_NAMES[name] in written}
        if old:
            as_written = pa.schema([f.with_name(old.get(f.name, f.name)) for f in schema])
            table = pq.read_table(path, columns=None if columns is None else [old.get(c, c) for c in columns],
                                  schema=as_written)
            new = {name: new for new, name in old.items()}
            return table.rename_columns([new.get(c, c) for c in table.column_names])
    return pq.read_table(path, columns=columns, schema=schema)


class SegmentStore:
    """The writer's side: one sequence of segments per kind, carried on across resumes."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(directory):  # a killed run's half-written segment
            if name.startswith(".") and name.endswith(TEMP_SUFFIX):
                (directory / name).unlink(missing_ok=True)
        self.next_seq = {kind: 1 + max((s.last for s in list_segments(directory, kind)), default=0)
                         for kind in SCHEMAS}

    def append(self, kind: str, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        seq = self.next_seq[kind]
        self._write(kind, pa.Table.from_pylist(records, schema=SCHEMAS[kind]), seq, seq)
        self.next_seq[kind] = seq + 1
        small = [s for s in list_segments(self.directory, kind) if s.first == s.last]
        if len(small) >= MERGE_SEGMENTS:
            self._merge(kind, small)

    def _merge(self, kind: str, segments: list[Segment]) -> None:
        table = read_kind(self.directory, kind, segments=segments)
        self._write(kind, table, segments[0].first, segments[-1].last)
        for seg in segments:  # a kill here leaves covered files, which readers skip
            seg.path.unlink(missing_ok=True)

    def _write(self, kind: str, table: pa.Table, first: int, last: int) -> None:
        final = self.directory / f"{kind}-{first:08d}-{last:08d}.parquet"
        temp = self.directory / f".{final.name}{TEMP_SUFFIX}"
        with open(temp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
