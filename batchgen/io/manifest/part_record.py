"""One committed part as the manifest records it: its file, checksum and per-row lists.

A part's per-row lists are compact (batchgen.io.ids.compact_lists: a million ids must not be a million
objects); `to_json` and `from_json` are its form in a manifest entry (batchgen.io.manifest.manifest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.io.ids.compact_lists import RowList
from batchgen.io.ids.lists import hash_list, id_list
from batchgen.io.store.writers import StagedPart

# The manifest's keys for a row's input file keep the word the format was first written with
# ("shard", since then the --num-shards partition's word alone): manifests and snapshots already
# written must load, and a batchgen of the version before must read what this one writes (a
# rollback mid-job resumes it). Only the persisted keys keep it; the code says file.
FILES_KEY = "shards"  # an entry's (or snapshot's) input file paths
FILE_KEY = "shard"  # a part's per-row index into FILES_KEY; a snapshot rows file's column of it
FILE_COUNTS_KEY = "shard_counts"  # a snapshot part's [[index into FILES_KEY, ok rows, error rows], ...]


@dataclass(slots=True)
class PartRecord:
    name: str
    temp: str  # the hidden name it was staged under; recovery publishes a leftover temp
    seq: int  # the entry that wrote this version of the part (0 until committed)
    num_rows: int
    num_bytes: int
    sha256: str
    # per row, compact (batchgen.io.ids.compact_lists: a million ids must not be a million objects)
    ids: RowList  # given as any list of ids, held as a RowList (equal to that list)
    error_ids: list[Any]  # the ids of its error rows
    file_counts: dict[str, list[int]]  # input file path -> [ok rows, error rows] from it
    files: list[str] | None = None  # per row: its input file's path (only when loaded with keep_rows)
    rows: list[int] | None = None  # per row: index within its file (only with keep_rows)
    hashes: RowList | None = None  # per row: its prompt hash (None for error rows and old parts)

    def __post_init__(self) -> None:
        self.ids = id_list(self.ids)
        if self.hashes is not None:
            self.hashes = hash_list(self.hashes)

    def ok_positions(self) -> list[int]:
        """Positions of its ok rows."""
        if not self.error_ids:
            return list(range(len(self.ids)))
        errors = set(self.error_ids)
        return [i for i, row_id in enumerate(self.ids) if row_id not in errors]

    def to_json(self, file_index: dict[str, int]) -> dict[str, Any]:
        assert self.files is not None and self.rows is not None, "a new part carries its rows"
        errors = set(self.error_ids)
        ids = list(self.ids)
        out = {"name": self.name, "temp": self.temp, "num_rows": self.num_rows, "num_bytes": self.num_bytes,
               "sha256": self.sha256, "ids": ids,
               "errors": [i for i, row_id in enumerate(ids) if row_id in errors],
               FILE_KEY: [file_index[f] for f in self.files], "row": self.rows}
        if self.hashes is not None:
            out["hashes"] = list(self.hashes)
        return out

    @classmethod
    def from_json(cls, p: dict[str, Any], seq: int, file_paths: list[str], keep_rows: bool) -> PartRecord:
        files = [file_paths[i] for i in p[FILE_KEY]]
        errors = set(p["errors"])
        return cls(p["name"], p["temp"], seq, p["num_rows"], p["num_bytes"], p["sha256"], p["ids"],
                   [p["ids"][i] for i in p["errors"]], _file_counts(files, errors),
                   files if keep_rows else None, p["row"] if keep_rows else None, p.get("hashes"))

    @classmethod
    def staged(cls, staged: StagedPart, ids: list[Any], is_error: list[bool], files: list[str],
               rows: list[int], hashes: list[str | None] | None = None, *, with_samples: bool = False) -> PartRecord:
        """`with_samples`: the part holds one row per sample (a sample_index column), a row's samples
        next to each other: its lists still have one entry per input row, and num_rows counts those."""
        assert len(ids) == len(is_error) == len(files) == len(rows)
        assert staged.num_rows >= len(ids) if with_samples else staged.num_rows == len(ids)
        assert hashes is None or len(hashes) == len(ids)
        errors = {i for i, e in enumerate(is_error) if e}
        return cls(staged.name, staged.temp, 0, len(ids), staged.num_bytes,
                   staged.sha256, ids, [ids[i] for i in sorted(errors)], _file_counts(files, errors),
                   files, rows, hashes)


def _file_counts(files: list[str], errors: set[int]) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    for i, file in enumerate(files):
        counts.setdefault(file, [0, 0])[i in errors] += 1
    return counts
