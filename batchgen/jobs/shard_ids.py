"""`batchgen finalize`'s check that no row id is committed by two shards, in bounded memory.

Each shard's ids are unique within it (its manifest refuses an id twice), so only ids shared
between shards matter. Holding every shard's ids in one dict would cost memory in proportion to
the whole job (about 100 bytes per id in Python: gigabytes for tens of millions of rows), on the
small machine that runs an Airflow finalize task. Instead each shard's ids, one shard at a time,
are spilled into hash buckets on local disk (one JSON Lines file per bucket, under a temporary
directory), and the buckets are then checked one by one: memory holds one shard's manifest
while spilling, then one bucket (about BUCKET_IDS ids).

An id is compared by its canonical JSON text: ids come from the manifests' JSON, so the same id
reads the same in every shard.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import zlib
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
        self.used: set[int] = set()

    def __enter__(self) -> SharedIdCheck:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def add(self, shard: int, ids: Iterable[Any]) -> None:
        pending: dict[int, list[str]] = {}
        count = 0
        for row_id in ids:
            text = json.dumps(row_id, separators=(",", ":"), ensure_ascii=False)
            pending.setdefault(zlib.crc32(text.encode()) % self.num_buckets, []).append(f"[{shard},{text}]\n")
            count += 1
            if count >= FLUSH_IDS:
                self._flush(pending)
                pending, count = {}, 0
        self._flush(pending)

    def _flush(self, pending: dict[int, list[str]]) -> None:
        for bucket, lines in pending.items():
            with open(self.directory / f"{bucket}.jsonl", "a", encoding="utf-8") as file:
                file.writelines(lines)
            self.used.add(bucket)

    def first_shared(self) -> tuple[Any, int, int] | None:
        """(id, first shard, second shard) of an id two shards committed, else None."""
        for bucket in sorted(self.used):
            owner: dict[str, int] = {}
            with open(self.directory / f"{bucket}.jsonl", encoding="utf-8") as file:
                for line in file:
                    shard_text, _, text = line[1:-2].partition(",")
                    shard = int(shard_text)
                    other = owner.setdefault(text, shard)
                    if other != shard:
                        return json.loads(text), other, shard
        return None
