"""Sharded jobs: how `--num-shards N --shard-index I` splits a job's input.

Every shard process (an Airflow mapped task, a cron line, a Kubernetes indexed job) computes the
split on its own, so it must come out the same everywhere: it is a pure function of input
metadata that every process reads alike (the files in the job's input order, Parquet footers' row
counts, file sizes), never of time, host or which shard asks.

The files are laid end to end in input order, each weighing its rows (every file Parquet: footers
count them) or, when any input is JSON Lines (its rows are unknown unread), its bytes. Shard I gets
the weight interval [W*I/N, W*(I+1)/N). A Parquet file that crosses a boundary is cut there, at a
row: shard I reads rows [start, stop) of it, and only the row groups holding them. A JSON Lines
file cannot be cut without reading it (a row's id is its line number), so it goes whole to the
shard that holds its midpoint: a job of a few large JSON Lines files balances only as well as its
files do (convert them to Parquet, or split them, to balance better).

Row ids do not change: a derived id is "<file>:<row index in the file>", with labels computed over
all the job's files, so a sharded job's output rows are the unsharded job's, row for row.
`--max-rows` keeps the job's first N rows before the split (Parquet inputs only: the footers say
where the first N rows end).

Here, with the input rows, because reading a shard's rows starts from its share
(batchgen.jobs.rows.rows); where each shard writes is batchgen.jobs.sharding.sharded's, and
`batchgen finalize` (batchgen.jobs.sharding.finalize) checks the set and writes the job's `_SUCCESS`.
"""

from __future__ import annotations

import dataclasses

from batchgen.errors import ConfigError
from batchgen.io.inputs.discovery import InputFile


def split_inputs(files: list[InputFile], num_shards: int, shard_index: int,
                 max_rows: int | None = None) -> list[InputFile]:
    """Shard `shard_index`'s share of `files` (all the job's files, in input order): the files it
    reads, each with the row range it reads where the file is cut (a Parquet file's `rows`)."""
    assert 0 <= shard_index < num_shards, (shard_index, num_shards)
    by_rows = all(f.num_rows is not None for f in files)
    if max_rows is not None and not by_rows:
        jsonl = next(f.path for f in files if f.num_rows is None)
        raise ConfigError(f"--max-rows with --num-shards needs Parquet inputs (their footers say where the first "
                          f"rows end); {jsonl} is JSON Lines")
    weights = [_weight(f, by_rows) for f in files]
    if max_rows is not None:  # the job's first max_rows rows, then the split
        kept, remaining = [], max_rows
        for w in weights:
            kept.append(min(w, remaining))
            remaining -= kept[-1]
        weights = kept
    total = sum(weights)
    lo, hi = total * shard_index // num_shards, total * (shard_index + 1) // num_shards  # [lo, hi)
    share, position = [], 0
    for f, w in zip(files, weights, strict=True):
        start_at, position = position, position + w
        file_rows = w if by_rows else f.num_rows  # by rows, w is the rows kept (--max-rows)
        if f.num_rows is None or file_rows == 0:
            # JSON Lines (whole, to the shard holding its midpoint), or nothing to read (listed, for
            # `batchgen status`, by the shard its place falls in): exactly one owner either way
            if _owner(start_at * 2 + w, total * 2, num_shards) == shard_index:
                share.append(f if f.num_rows is None else dataclasses.replace(f, rows=(0, 0)))
            continue
        start, stop = _row_at(lo - start_at, w, file_rows), _row_at(hi - start_at, w, file_rows)
        if stop > start:  # consecutive shards' boundaries are equal: their ranges tile the file
            share.append(dataclasses.replace(f, rows=(start, stop)))
    return share


def _owner(point: int, total: int, num_shards: int) -> int:
    """The shard whose weight interval holds `point` (of `total`); the last one for the end."""
    return 0 if total == 0 else min(point * num_shards // total, num_shards - 1)


def _weight(f: InputFile, by_rows: bool) -> int:
    if by_rows:
        return f.num_rows
    return max(f.size or 0, 1)  # bytes; a size the filesystem does not give still takes a place


def _row_at(offset: int, weight: int, num_rows: int) -> int:
    """The first row of a file (of `weight` spread evenly over `num_rows`) at or after weight
    `offset` from its start: row r starts at r*weight/num_rows. Clamped to [0, num_rows]."""
    if offset <= 0:
        return 0
    return min(-(-offset * num_rows // weight), num_rows)
