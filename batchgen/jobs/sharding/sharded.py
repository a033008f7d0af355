"""A sharded job's output directory as a whole: its shard directories, and `status` and `compact` over them.

    OUTPUT/shard-0-of-N/ ... shard-(N-1)-of-N/   one ordinary job directory per shard (manifest, lock,
                                                  parts, its own _SUCCESS), written by `run --shard-index I`
    OUTPUT/_SUCCESS, OUTPUT/_summary.json         written by `batchgen finalize` once the set is checked
    OUTPUT/output.jsonl, errors.jsonl             the job's OpenAI Batch files, by finalize too, when the shards
      (or OUTPUT/_openai_batch/ for `both`)       ran with --output-format openai-batch or both

Each shard writes its shard-I-of-N/ (shard_output_dir) with the ordinary commit protocol. OUTPUT
is a local directory or an object-store prefix (s3://bucket/prefix, batchgen.io.store.store): each
shard-I-of-N/ is then a prefix with its own manifest and lease, and finalize writes the job's
files with one PUT each, _SUCCESS last.

A reader of the whole output (`pyarrow.dataset` over OUTPUT, Spark, DuckDB's `**/*.parquet`) sees
every shard's parts: the bookkeeping names start with "_" or "." and are skipped by them. It waits
for OUTPUT/_SUCCESS, as it would for one directory's.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE, is_job_dir
from batchgen.io.store.factory import is_url, open_store
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.jobs.openai.output import BATCH_BOTH_DIR, BATCH_FILES

log = logging.getLogger("batchgen")

SHARD_DIR_RE = re.compile(r"shard-(\d+)-of-(\d+)")


def shard_dir_name(shard_index: int, num_shards: int) -> str:
    return f"shard-{shard_index}-of-{num_shards}"


def shard_output_dir(output: str | Path, shard_index: int | None, num_shards: int | None) -> str | Path:
    """Where a run writes: OUTPUT itself, or OUTPUT/shard-I-of-N/ for one shard of a sharded job;
    a local Path, or a URL (str) under an object-store OUTPUT (s3://bucket/prefix/shard-I-of-N)."""
    if is_url(output):
        url = str(output).rstrip("/")
        return url if num_shards is None else f"{url}/{shard_dir_name(shard_index, num_shards)}"
    if num_shards is None:
        return Path(output)
    assert shard_index is not None
    return Path(output) / shard_dir_name(shard_index, num_shards)


def parse_shard_dir(name: str) -> tuple[int, int] | None:
    """(shard index, number of shards) of a shard directory's name, else None."""
    match = SHARD_DIR_RE.fullmatch(name)
    if match is None:
        return None
    index, num = int(match.group(1)), int(match.group(2))
    return (index, num) if 0 <= index < num and name == shard_dir_name(index, num) else None


# what finalize writes beside the shard directories (the OpenAI Batch files of openai-batch/both jobs)
JOB_FILES = (SUCCESS_FILE, "_summary.json", *BATCH_FILES, BATCH_BOTH_DIR)


@dataclass(frozen=True, slots=True)
class ShardDir:
    index: int
    num_shards: int
    store: OutputStore  # OUTPUT/shard-I-of-N/: a local directory or an object-store prefix

    @property
    def path(self) -> Path | OutputStore:
        """A local Path where there is one, else the store (its str is the URL): what messages show."""
        return self.store.path() if isinstance(self.store, LocalStore) else self.store


def output_location(output: str | Path | OutputStore) -> Path | OutputStore:
    """The store's local Path where it has one, else the store: what messages and results show."""
    store = open_store(output)
    return store.path() if isinstance(store, LocalStore) else store


def list_shard_dirs(output: str | Path | OutputStore) -> list[ShardDir]:
    """The shard-I-of-N/ directories (or prefixes) under OUTPUT, by N then I."""
    store = open_store(output)
    found = []
    for name, size in store.list().items():
        parsed = parse_shard_dir(name) if size is None else None  # None: a directory / common prefix
        if parsed is not None:
            found.append(ShardDir(parsed[0], parsed[1], store.sub(name)))
    return sorted(found, key=lambda d: (d.num_shards, d.index))


def is_sharded_output(output: str | Path | OutputStore) -> bool:
    return not is_job_dir(output) and bool(list_shard_dirs(output))


def num_shards_of(output: Path | OutputStore, dirs: list[ShardDir]) -> int:
    """The one N of the set; shards of two splits (another --num-shards) are refused."""
    splits = sorted({d.num_shards for d in dirs})
    if len(splits) > 1:
        raise OutputError(f"{output} holds shards of {len(splits)} different splits (--num-shards "
                          f"{', '.join(map(str, splits))}); one job has one split: remove the directories of the "
                          "other, or rerun every shard into a new --output")
    return splits[0]


def check_job_output(output: str | Path | OutputStore, num_shards: int) -> None:
    """Before a shard runs: OUTPUT must be new, empty, or this sharded job's (shards of the same N)."""
    store = open_store(output)
    output = output_location(store)
    if is_job_dir(store):
        raise OutputError(f"{output} holds the output of an unsharded job (it has a _manifest); a sharded job "
                          "needs its own --output directory")
    names = store.list()
    if not names:
        return
    others = sorted({d.num_shards for d in list_shard_dirs(store)} - {num_shards})
    if others:
        raise OutputError(f"{output} holds shards of a {others[0]}-shard split ({shard_dir_name(0, others[0])}/, "
                          f"...); every shard of a job runs with the same --num-shards: pass --num-shards "
                          f"{others[0]}, or choose a new --output")
    ours = {shard_dir_name(i, num_shards) for i in range(num_shards)} | set(JOB_FILES)
    foreign = sorted(name for name in names if name not in ours and not name.startswith("."))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputError(f"{output} is not empty and is not a sharded batchgen job's output directory (it holds "
                          f"{shown}); readers of the whole output would read those too: choose a new or empty "
                          "--output directory")
