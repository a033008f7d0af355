"""Input shards: find the files a job reads, check them early, stream them as bounded record batches.

Every path goes through pyarrow.fs, so s3://, gs:// (and any scheme pyarrow knows) work wherever
the user has credentials, and local paths need no special case beyond making them absolute.
Problems a user can fix (missing file, corrupt footer, bad JSON line) raise InputError naming the
file, and where known the row and column, before any generation starts where that is possible.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchgen.errors import InputError
from batchgen.io.schema import infer_schema, read_records, records_to_batches

logger = logging.getLogger(__name__)

# File name suffix -> format. ".json" means JSON Lines too (one object per line), as in most
# batch tools; a file holding one JSON array fails with a message that says so.
FORMAT_BY_SUFFIX = {".parquet": "parquet", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json": "jsonl"}
SUPPORTED_SUFFIXES = ", ".join(FORMAT_BY_SUFFIX)  # for error messages
# A directory may also hold configs, _SUCCESS markers and .crc files: take only unambiguous inputs.
DIRECTORY_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz")
# Records read to decide a JSONL shard's columns and types; they are held in memory meanwhile,
# so this bounds memory as well as how late in a file a new key or a type conflict can hide.
JSONL_SCHEMA_SAMPLE_RECORDS = 1000
# Batch schema metadata listing the cells that did not hold valid text (see iter_batches).
INVALID_CELLS_KEY = b"batchgen.invalid_cells"
_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class InputShard:
    path: str  # as resolved: an absolute local path, or a URI such as s3://bucket/key
    format: str  # "parquet" | "jsonl"
    num_rows: int | None  # from the Parquet footer; None for JSONL (unknown without reading it)


# ---------------------------------------------------------------- finding the shards


def resolve_inputs(patterns: list[str]) -> list[InputShard]:
    """Expand files, directories (recursively) and globs into shards, in a stable order.

    Order: pattern by pattern, sorted by path within each; a file named twice is kept once, at
    its first place. Parquet footers are read here, so a corrupt file fails before generation.
    Names starting with "." or "_" (bookkeeping, temp files) are skipped inside directories and
    by wildcards, as pyarrow.dataset does.
    """
    shards: dict[str, InputShard] = {}
    for pattern in patterns:
        for shard in _resolve_pattern(pattern):
            shards.setdefault(shard.path, shard)
    return list(shards.values())


def _resolve_pattern(pattern: str) -> list[InputShard]:
    fs, uri_prefix, fs_pattern = _locate(pattern)
    head, glob_parts = _split_at_glob(fs_pattern)
    if glob_parts:
        files = _glob(fs, head, glob_parts, pattern)
    else:
        try:
            info = fs.get_file_info(fs_pattern)
        except OSError as e:
            raise InputError(f"cannot read: {e}", path=pattern) from e
        if info.type == pafs.FileType.NotFound:
            raise InputError("no such file or directory", path=pattern)
        if info.type == pafs.FileType.Directory:
            files = _walk_directory(fs, fs_pattern, pattern, required=True)
        else:
            _format_of(fs_pattern, pattern)  # an explicitly named file must have a known suffix
            files = [info]
    return [_open_shard(fs, info, uri_prefix + info.path) for info in files]


def _locate(pattern: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, URI prefix that turns its paths back into URIs, path inside it)."""
    if not _URI_RE.match(pattern):
        return pafs.LocalFileSystem(), "", os.path.abspath(os.path.expanduser(pattern))
    # from_uri parses a URI, and "?" or "[" in a glob would be misread: give it the plain head only.
    head, glob_parts = _split_at_glob(pattern)
    head = head.rstrip("/")
    fs, head_path = _filesystem(head)
    if head_path and head.endswith(head_path):
        uri_prefix = head[: len(head) - len(head_path)]
    else:
        uri_prefix = head.split("://", 1)[0] + "://"
    return fs, uri_prefix, "/".join([head_path, *glob_parts])


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding `path` (a URI or a local path) and the path inside it."""
    if not _URI_RE.match(path):
        return pafs.LocalFileSystem(), path
    try:
        return pafs.FileSystem.from_uri(path)
    except (OSError, pa.ArrowInvalid) as e:  # unknown scheme, no credentials, no network
        raise InputError(f"cannot open the filesystem: {e}", path=path) from e


def _split_at_glob(path: str) -> tuple[str, list[str]]:
    """Split before the first segment with a wildcard: (plain head, remaining segments)."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if _GLOB_CHARS & set(part):
            return "/".join(parts[:i]) or "/", parts[i:]
    return path, []


def _list(fs: pafs.FileSystem, dir_path: str, recursive: bool, display: str) -> list[pafs.FileInfo]:
    selector = pafs.FileSelector(dir_path, recursive=recursive, allow_not_found=True)
    try:
        return fs.get_file_info(selector)
    except OSError as e:
        raise InputError(f"cannot list: {e}", path=display) from e


def _relative_parts(info: pafs.FileInfo, dir_path: str) -> list[str]:
    assert info.path.startswith(dir_path), (info.path, dir_path)
    return info.path[len(dir_path) :].strip("/").split("/")


def _is_hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _walk_directory(fs: pafs.FileSystem, dir_path: str, display: str, *, required: bool) -> list:
    infos = [
        info
        for info in _list(fs, dir_path, True, display)
        if info.type == pafs.FileType.File
        and info.path.lower().endswith(DIRECTORY_SUFFIXES)
        and not any(_is_hidden(part) for part in _relative_parts(info, dir_path))
    ]
    if required and not infos:
        raise InputError(f"directory has no input files ({', '.join(DIRECTORY_SUFFIXES)})", path=display)
    return sorted(infos, key=lambda info: info.path)


def _glob(fs: pafs.FileSystem, head: str, glob_parts: list[str], display: str) -> list:
    recursive = len(glob_parts) > 1 or "**" in glob_parts
    matched = [
        info
        for info in _list(fs, head, recursive, display)
        if _match_parts(glob_parts, _relative_parts(info, head))
    ]
    if not matched:
        raise InputError("pattern matched no files", path=display)
    files: dict[str, pafs.FileInfo] = {}
    for info in sorted(matched, key=lambda info: info.path):
        if info.type == pafs.FileType.Directory:
            for inner in _walk_directory(fs, info.path, display, required=False):
                files.setdefault(inner.path, inner)
        elif info.path.lower().endswith(tuple(FORMAT_BY_SUFFIX)):
            files.setdefault(info.path, info)
    if not files:
        raise InputError(
            f"pattern matched {len(matched)} entries but no input files (supported: {SUPPORTED_SUFFIXES})",
            path=display,
        )
    return sorted(files.values(), key=lambda info: info.path)


def _match_parts(pattern_parts: list[str], name_parts: list[str]) -> bool:
    """Segment-wise glob: "*" stays within one segment, "**" spans any number of segments."""
    if not pattern_parts:
        return not name_parts
    first, rest = pattern_parts[0], pattern_parts[1:]
    if first == "**":
        if _match_parts(rest, name_parts):
            return True
        # "**" takes one more segment and stays, but never walks into a hidden directory.
        if not name_parts or _is_hidden(name_parts[0]):
            return False
        return _match_parts(pattern_parts, name_parts[1:])
    if not name_parts:
        return False
    name = name_parts[0]
    # Like a shell, a wildcard does not pick up hidden names unless the pattern spells the prefix.
    if _is_hidden(name) and not first.startswith(name[0]):
        return False
    return fnmatch.fnmatchcase(name, first) and _match_parts(rest, name_parts[1:])


def _format_of(path: str, display: str) -> str:
    lowered = path.lower()
    # Longest suffix first, so "x.jsonl.gz" is not taken for something ending in ".gz" alone.
    for suffix in sorted(FORMAT_BY_SUFFIX, key=len, reverse=True):
        if lowered.endswith(suffix):
            return FORMAT_BY_SUFFIX[suffix]
    raise InputError(f"unsupported file type (supported: {SUPPORTED_SUFFIXES})", path=display)


def _open_shard(fs: pafs.FileSystem, info: pafs.FileInfo, display: str) -> InputShard:
    fmt = _format_of(info.path, display)
    if info.size == 0:
        raise InputError("file is empty (0 bytes)", path=display)
    num_rows = None
    if fmt == "parquet":
        with _open_parquet(fs, info.path, display) as parquet_file:
            num_rows = parquet_file.metadata.num_rows
    return InputShard(path=display, format=fmt, num_rows=num_rows)


# ---------------------------------------------------------------- Parquet


@contextlib.contextmanager
def _open_parquet(fs: pafs.FileSystem, fs_path: str, display: str) -> Iterator[pq.ParquetFile]:
    """Open a Parquet file through its filesystem; a bad footer is an InputError naming it."""
    try:
        file = fs.open_input_file(fs_path)
    except FileNotFoundError as e:
        raise InputError("no such file", path=display) from e
    except OSError as e:
        raise InputError(f"cannot open: {e}", path=display) from e
    with file:  # ParquetFile does not close a file it was handed
        try:
            parquet_file = pq.ParquetFile(file)
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"not a valid Parquet file: {e}", path=display) from e
        yield parquet_file


def _parquet_batches(
    shard: InputShard, columns: list[str] | None, batch_size: int
) -> Iterator[pa.RecordBatch]:
    num_rows_read = 0
    with _open_parquet(*_filesystem(shard.path), shard.path) as parquet_file:
        batches = parquet_file.iter_batches(batch_size=batch_size, columns=columns)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError) as e:  # a corrupt page or column chunk
                raise InputError(f"cannot read Parquet data: {e}", path=shard.path, row=num_rows_read) from e
            if batch.num_rows:  # a row group may be empty; callers count rows, not batches
                num_rows_read += batch.num_rows
                yield _repair_utf8(batch)


def _repair_utf8(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Parquet does not check that string cells are UTF-8; to_pylist would crash on one that is not.

    Such a cell is decoded with U+FFFD replacements and listed under INVALID_CELLS_KEY.
    """
    invalid = []
    columns = list(batch.columns)
    for i, field in enumerate(batch.schema):
        if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
            continue
        try:
            columns[i].validate(full=True)  # a vectorised UTF-8 check; the slow path below is rare
            continue
        except pa.ArrowInvalid:
            pass
        raw_type = pa.binary() if pa.types.is_string(field.type) else pa.large_binary()
        values = []
        for row, raw in enumerate(columns[i].view(raw_type).to_pylist()):
            try:
                values.append(None if raw is None else raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                values.append(raw.decode("utf-8", "replace"))
                invalid.append([row, field.name, f"column {field.name!r} is not valid UTF-8 (byte "
                                                 f"{raw[e.start]:#04x} at offset {e.start})"])
        columns[i] = pa.array(values, field.type)
    if not invalid:
        return batch
    metadata = {**(batch.schema.metadata or {}), INVALID_CELLS_KEY: json.dumps(invalid)}
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema.with_metadata(metadata))


# ---------------------------------------------------------------- JSON Lines


def _records(shard: InputShard) -> Iterator[tuple[int, dict[str, Any]]]:
    fs, fs_path = _filesystem(shard.path)
    # pyarrow decompresses on the fly; only gzip is a supported input compression (".jsonl.gz").
    compression = "gzip" if shard.path.lower().endswith(".gz") else None
    try:
        stream = fs.open_input_stream(fs_path, compression=compression)
    except FileNotFoundError as e:
        raise InputError("no such file", path=shard.path) from e
    except OSError as e:
        raise InputError(f"cannot open: {e}", path=shard.path) from e
    with stream:
        yield from read_records(stream, shard.path)


def _sample_jsonl(shard: InputShard) -> tuple[pa.Schema, list[tuple[int, dict]], Iterator]:
    """(schema from the first records, those records, the iterator positioned after them)."""
    records = _records(shard)
    sample = list(itertools.islice(records, JSONL_SCHEMA_SAMPLE_RECORDS))
    if not sample:
        records.close()
        raise InputError("file is empty (no JSON records)", path=shard.path)
    return infer_schema([record for _, record in sample]), sample, records


# ---------------------------------------------------------------- reading a shard


def read_schema(shard: InputShard) -> pa.Schema:
    """The shard's Arrow schema: the Parquet schema, or the one JSONL batches will carry."""
    if shard.format == "parquet":
        with _open_parquet(*_filesystem(shard.path), shard.path) as parquet_file:
            return parquet_file.schema_arrow
    schema, _, records = _sample_jsonl(shard)
    records.close()
    return schema


def read_columns(shard: InputShard) -> list[str]:
    """Column names: Parquet's schema, or for JSONL the keys of its first records, first seen first."""
    return read_schema(shard).names


def count_rows(shard: InputShard) -> int | None:
    """Rows in the shard from Parquet metadata; None for JSONL, which would need a full read."""
    return shard.num_rows


def iter_batches(shard: InputShard, columns: list[str] | None, batch_size: int) -> Iterator[pa.RecordBatch]:
    """Stream the shard in file order as record batches of at most `batch_size` rows.

    Only `columns` are read (None = all), in the order given. The i-th row over all batches is
    row i of the shard (0-based); for JSONL that is the i-th non-blank line. Missing columns are
    checked before the first batch, so this raises at once rather than on first iteration.

    JSON Lines policy (details in batchgen.io.schema):
      - each line is decoded as strict UTF-8 and parsed with `json.loads`; blank lines are skipped;
      - a malformed line, invalid UTF-8 or a record that is not an object raises InputError naming
        the file, the row and the 1-based line number;
      - except a last line with no trailing newline that does not parse: a writer killed mid-line
        leaves exactly that, so it is skipped with a logged warning rather than failing the job;
      - columns and types come from the first JSONL_SCHEMA_SAMPLE_RECORDS records; keys absent
        from a record read as null; a column whose JSON kinds conflict becomes a string column
        holding JSON text (nothing is dropped or rounded); a later value that cannot fit its
        column's type raises InputError with file, row and column;
      - a lone surrogate (a "\\ud800" escape with no partner) is not Unicode text and cannot be
        stored as UTF-8: it is replaced by U+FFFD and the cell listed as invalid (below).

    Cells that did not hold valid text (invalid UTF-8 in a Parquet string column, a lone
    surrogate in JSON) are read with U+FFFD replacements, so one bad cell cannot stop a job; the
    batch lists them in its schema metadata under INVALID_CELLS_KEY as JSON
    [[row in batch, column, message], ...], and RowSource turns each such row into an error row.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if shard.format == "parquet":
        _check_columns(shard, columns, read_columns(shard))
        return _parquet_batches(shard, columns, batch_size)
    schema, sample, records = _sample_jsonl(shard)
    try:
        _check_columns(shard, columns, schema.names)
    except InputError:
        records.close()
        raise
    if columns is not None:
        schema = pa.schema([schema.field(name) for name in columns])
    invalid: dict[int, list] = {}
    batches = records_to_batches(
        _scrub_surrogates(itertools.chain(sample, records), schema.names, invalid), schema, batch_size,
        shard.path, num_sample_records=JSONL_SCHEMA_SAMPLE_RECORDS, warn_new_keys=columns is None,
    )
    return _mark_invalid(batches, invalid)


def _scrub_surrogates(records: Iterator[tuple[int, dict]], names: list[str], invalid: dict[int, list]
                      ) -> Iterator[tuple[int, dict]]:
    for row, record in records:
        for name in names:
            value = record.get(name)
            if value is not None and not isinstance(value, (int, float)) and _has_surrogate(value):
                record[name] = _scrub(value)
                invalid.setdefault(row, []).append(
                    [name, f"column {name!r} holds a lone surrogate escape, which is not valid Unicode"])
        yield row, record


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return not value.isascii() and _SURROGATE_RE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE_RE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _mark_invalid(batches: Iterator[pa.RecordBatch], invalid: dict[int, list]) -> Iterator[pa.RecordBatch]:
    first_row = 0
    for batch in batches:
        end = first_row + batch.num_rows
        cells = [[row - first_row, name, message] for row in sorted(r for r in invalid if r < end)
                 for name, message in invalid.pop(row)] if invalid else []
        first_row = end
        if cells:
            metadata = {**(batch.schema.metadata or {}), INVALID_CELLS_KEY: json.dumps(cells)}
            batch = batch.replace_schema_metadata(metadata)
        yield batch


def invalid_cells(batch: pa.RecordBatch) -> dict[int, str]:
    """{row in batch: message} for the cells iter_batches had to repair (see its docstring)."""
    raw = (batch.schema.metadata or {}).get(INVALID_CELLS_KEY)
    if raw is None:
        return {}
    out: dict[int, str] = {}
    for row, _column, message in json.loads(raw):
        out[row] = f"{out[row]}; {message}" if row in out else message
    return out


def _check_columns(shard: InputShard, columns: list[str] | None, existing: list[str]) -> None:
    if columns is None:
        return
    assert len(set(columns)) == len(columns), f"duplicate columns requested: {columns}"
    for name in columns:
        if name not in existing:
            listed = ", ".join(repr(c) for c in existing[:50]) + (", ..." if len(existing) > 50 else "")
            raise InputError(f"no such column; the file has: {listed}", path=shard.path, column=name)
