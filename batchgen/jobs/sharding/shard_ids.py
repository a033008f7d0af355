"""`batchgen finalize`'s check that no row id is committed by two shards, in bounded memory.

Each shard's ids are unique within it (its manifest refuses an id twice), so only ids shared
between shards matter. Holding every shard's ids in one dict would cost memory in proportion to
the whole job (about 100 bytes per id in Python: gigabytes for tens of millions of rows), on the
small machine that runs an Airflow finalize task. Instead each shard's ids, one shard at a time,
are spilled into hash buckets on local disk (one JSON Lines file per bucket, under a temporary
directory), and the buckets are then checked one by one: memory holds one shard's manifest
while spilling, then one bucket (about BUCKET_IDS ids).

An id is compared by its repr: ids come from the manifests' JSON (a str, an int, a float), all of
one column's type, so the same id has the same repr in every shard; a str's repr escapes newlines,
so one id is one line. The bucket is the hash of that text (salted per process: spill and check
run in the same one). A shared id is read back with ast.literal_eval, which parses a literal and
never runs code.
"""

from __future__ import annotations

import ast
import math
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BUCKET_IDS = 1_000_000  # ids per bucket, aimed at: a bucket's dict stays around 100 MB
FLUSH_IDS = 65_536  # ids gathered in memory before they are appended to their bucket files


class SharedIdCheck:
    """`add(shard, ids)` for every shard, then `first_shared()`; `close()` removes the spill."""

    def __init__(self, expected_ids: int, *, bucket_ids: int = BUCKET_IDS):
        self.num_buckets = max(1, math.ceil(expected_ids / bucket_ids))
        self.directory = Path(tempfile.mkdtemp(prefix="batchgen-finalize-"))
        self.files: dict[int, list[tuple[int, Path]]] = {}  # bucket -> [(shard, its file)], in add order

    def __enter__(self) -> SharedIdCheck:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def add(self, shard: int, ids: Iterable[Any]) -> None:
        """Spill one shard's ids (unique within it), into one file per bucket."""
        num_buckets = self.num_buckets
        pending: list[list[str]] = [[] for _ in range(num_buckets)]
        count = 0
        for row_id in ids:
            text = repr(row_id)
            pending[hash(text) % num_buckets].append(text)
            count += 1
            if count >= FLUSH_IDS:
                self._flush(shard, pending)
                pending, count = [[] for _ in range(num_buckets)], 0
        self._flush(shard, pending)

    def _flush(self, shard: int, pending: list[list[str]]) -> None:
        for bucket, lines in enumerate(pending):
            if not lines:
                continue
            path = self.directory / f"{bucket}-{shard}.txt"
            with open(path, "a", encoding="utf-8") as file:
                file.write("\n".join(lines))
                file.write("\n")
            files = self.files.setdefault(bucket, [])
            if not files or files[-1][0] != shard:
                files.append((shard, path))

    def first_shared(self) -> tuple[Any, int, int] | None:
        """(id, first shard, second shard) of an id two shards committed, else None."""
        for bucket in sorted(self.files):
            owner: dict[str, int] = {}
            for shard, path in self.files[bucket]:
                with open(path, encoding="utf-8") as file:
                    for line in file:
                        other = owner.setdefault(line, shard)
                        if other != shard:
                            return ast.literal_eval(line[:-1]), other, shard
        return None
