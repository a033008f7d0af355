"""The split of a sharded job's input: deterministic, tiling every file exactly once, balanced."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.config.rules import check_shard_flags
from batchgen.errors import ConfigError
from batchgen.io.inputs.discovery import InputFile
from batchgen.jobs.rows.split import split_inputs
from batchgen.jobs.sharding.sharded import parse_shard_dir, shard_dir_name


def parquet(name: str, rows: int, size: int | None = None) -> InputFile:
    return InputFile(f"/in/{name}.parquet", "parquet", rows, size=size or rows * 10 + 100)


def jsonl(name: str, size: int) -> InputFile:
    return InputFile(f"/in/{name}.jsonl", "jsonl", None, size=size)


def rows_by_file(files, num_shards, max_rows=None) -> dict[str, list[tuple[int, int, int]]]:
    """path -> [(start, stop, shard)] over every shard's share."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for index in range(num_shards):
        for f in split_inputs(files, num_shards, index, max_rows):
            start, stop = f.rows if f.rows is not None else (0, -1)
            out.setdefault(f.path, []).append((start, stop, index))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=6), st.integers(1, 9))
def test_parquet_rows_tile_every_file_and_balance(counts, num_shards):
    files = [parquet(f"f{i}", n) for i, n in enumerate(counts)]
    by_file = rows_by_file(files, num_shards)
    for f in files:
        ranges = sorted(by_file[f.path])
        if f.num_rows == 0:
            assert ranges == [(0, 0, ranges[0][2])]  # listed once, nothing to read
            continue
        assert ranges[0][0] == 0 and ranges[-1][1] == f.num_rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous, no overlap
    per_shard = [sum(f.num_rows_read for f in split_inputs(files, num_shards, i)) for i in range(num_shards)]
    total = sum(counts)
    assert sum(per_shard) == total
    assert max(per_shard) - min(per_shard) <= 1  # by rows: as even as integers allow


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), min_size=1, max_size=8), st.integers(1, 6))
def test_mixed_inputs_give_each_jsonl_file_to_one_shard_and_cut_parquet_by_bytes(specs, num_shards):
    files = [jsonl(f"j{i}", size) if is_jsonl else parquet(f"p{i}", size // 7, size=size)
             for i, (is_jsonl, size) in enumerate(specs)]
    by_file = rows_by_file(files, num_shards)
    for f in files:
        if f.format == "jsonl":
            assert len(by_file[f.path]) == 1 and by_file[f.path][0][:2] == (0, -1)  # whole, in one shard
        elif f.num_rows:
            ranges = sorted(by_file[f.path])
            assert ranges[0][0] == 0 and ranges[-1][1] == f.num_rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_a_large_file_is_cut_into_row_ranges_and_small_files_stay_whole():
    files = [parquet("big", 900), parquet("a", 50), parquet("b", 50)]
    shares = [split_inputs(files, 2, i) for i in range(2)]
    assert [(f.path, f.rows) for f in shares[0]] == [("/in/big.parquet", (0, 500))]
    assert [(f.path, f.rows) for f in shares[1]] == [("/in/big.parquet", (500, 900)), ("/in/a.parquet", (0, 50)),
                                                     ("/in/b.parquet", (0, 50))]


def test_the_split_is_a_function_of_the_metadata_alone():
    files = [parquet("a", 123), jsonl("b", 4000), parquet("c", 77)]
    assert split_inputs(files, 3, 1) == split_inputs(list(files), 3, 1)


def test_max_rows_keeps_the_jobs_first_rows_then_splits():
    files = [parquet("a", 100), parquet("b", 100)]
    shares = [split_inputs(files, 2, i, max_rows=150) for i in range(2)]
    assert [(f.path, f.rows) for f in shares[0]] == [("/in/a.parquet", (0, 75))]
    assert [(f.path, f.rows) for f in shares[1]] == [("/in/a.parquet", (75, 100)), ("/in/b.parquet", (0, 50))]
    with pytest.raises(ConfigError, match="needs Parquet inputs"):
        split_inputs([jsonl("j", 100)], 2, 0, max_rows=5)


def test_more_shards_than_rows_leaves_some_shards_empty():
    shares = [split_inputs([parquet("a", 2)], 4, i) for i in range(4)]
    assert sum(f.num_rows_read for s in shares for f in s) == 2
    assert sum(1 for s in shares if not s) == 2


def test_shard_directory_names_round_trip():
    assert shard_dir_name(3, 8) == "shard-3-of-8"
    assert parse_shard_dir("shard-3-of-8") == (3, 8)
    for bad in ("shard-8-of-8", "shard-03-of-8", "shard-1-of-2x", "part-1"):
        assert parse_shard_dir(bad) is None


@pytest.mark.parametrize(("num", "index", "match"), [(2, None, "needs --shard-index"), (None, 0, "needs --num-shards"),
                                                     (0, 0, ">= 1"), (2, 2, r"\[0, 1\]"), (2, -1, r"\[0, 1\]")])
def test_shard_flags_are_checked(num, index, match):
    with pytest.raises(ConfigError, match=match):
        check_shard_flags(num, index)
