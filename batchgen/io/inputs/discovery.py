"""Finding a job's input files: files, directories and globs, on any filesystem pyarrow knows.

Every path goes through pyarrow.fs, so s3://, gs:// (and any scheme pyarrow knows) work wherever
the user has credentials, and local paths need no special case beyond making them absolute.
Problems a user can fix (no such file, a pattern that matches nothing, an unknown suffix, an
empty or corrupt file) raise InputError naming the file, before any generation starts.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.errors import InputError
from batchgen.io.inputs.parquet import open_parquet

# File name suffix -> format. ".json" means JSON Lines too (one object per line), as in most
# batch tools; a file holding one JSON array fails with a message that says so.
FORMAT_BY_SUFFIX = {".parquet": "parquet", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json": "jsonl"}
SUPPORTED_SUFFIXES = ", ".join(FORMAT_BY_SUFFIX)  # for error messages
# A directory may also hold configs, _SUCCESS markers and .crc files: take only unambiguous inputs.
DIRECTORY_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz")
# --input-format: "auto" reads each file by its suffix; "parquet" and "jsonl" read every file as that
# format, whatever its suffix; "openai-batch" reads JSON Lines files as OpenAI Batch API requests
# (batchgen.io.inputs.openai_batch), which come in no other format.
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json")
_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class InputFile:
    path: str  # as resolved: an absolute local path, or a URI such as s3://bucket/key
    format: str  # "parquet" | "jsonl" | "openai-batch"
    num_rows: int | None  # from the Parquet footer; None for JSONL (unknown without reading it)
    size: int | None = None  # bytes, as the filesystem reports them
    mtime_ns: int | None = None  # modification time, where the filesystem gives one
    # the rows [start, stop) a sharded job's share reads (batchgen.jobs.rows.split); None = the whole file
    rows: tuple[int, int] | None = None

    @property
    def num_rows_read(self) -> int | None:
        """Rows read of this file: its row range's, else the file's (None: JSONL, unknown unread)."""
        return self.rows[1] - self.rows[0] if self.rows is not None else self.num_rows

    @property
    def first_row(self) -> int:
        """Index in the file of the first row read (row ids count from the file's start)."""
        return self.rows[0] if self.rows is not None else 0


def resolve_inputs(patterns: list[str], input_format: str = "auto") -> list[InputFile]:
    """Expand files, directories (recursively) and globs into input files, in a stable order.

    Order: pattern by pattern, sorted by path within each; a file named twice is kept once, at
    its first place. Parquet footers are read here, so a corrupt file fails before generation.
    Names starting with "." or "_" (bookkeeping, temp files) are skipped inside directories and
    by wildcards, as pyarrow.dataset does. `input_format` (see JSONL_SUFFIXES above) overrides the
    format a file's suffix gives.
    """
    found: dict[str, InputFile] = {}
    for pattern in patterns:
        for file in _resolve_pattern(pattern, input_format):
            found.setdefault(file.path, file)
    return list(found.values())


def _resolve_pattern(pattern: str, input_format: str) -> list[InputFile]:
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
            if input_format == "auto":
                _format_of(fs_pattern, pattern)  # an explicitly named file must have a known suffix
            files = [info]
    return [_open_file(fs, info, uri_prefix + info.path, input_format) for info in files]


def _locate(pattern: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, URI prefix that turns its paths back into URIs, path inside it)."""
    if not _URI_RE.match(pattern):
        return pafs.LocalFileSystem(), "", os.path.abspath(os.path.expanduser(pattern))
    # from_uri parses a URI, and "?" or "[" in a glob would be misread: give it the plain head only.
    head, glob_parts = _split_at_glob(pattern)
    head = head.rstrip("/")
    fs, head_path = filesystem(head)
    if head_path and head.endswith(head_path):
        uri_prefix = head[: len(head) - len(head_path)]
    else:
        uri_prefix = head.split("://", 1)[0] + "://"
    return fs, uri_prefix, "/".join([head_path, *glob_parts])


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
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


def _open_file(fs: pafs.FileSystem, info: pafs.FileInfo, display: str, input_format: str = "auto") -> InputFile:
    if input_format == "openai-batch":
        if not info.path.lower().endswith(JSONL_SUFFIXES):
            raise InputError(f"--input-format openai-batch reads JSON Lines files ({', '.join(JSONL_SUFFIXES)}), "
                             "the Batch API's request format", path=display)
        fmt = input_format
    else:
        fmt = _format_of(info.path, display) if input_format == "auto" else input_format
    num_rows = None
    if info.size == 0:  # an empty file holds no rows (readers.py reads it as such), whatever its format
        num_rows = 0 if fmt == "parquet" else None
    elif fmt == "parquet":
        with open_parquet(fs, info.path, display) as parquet_file:
            num_rows = parquet_file.metadata.num_rows
    return InputFile(path=display, format=fmt, num_rows=num_rows, size=info.size, mtime_ns=info.mtime_ns)
