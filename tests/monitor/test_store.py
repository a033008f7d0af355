"""_metrics/ segments: closed files only, merged every MERGE_SEGMENTS, read once each even when a kill
left a merged file beside the segments it replaced, and an unreadable file skipped."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from batchgen.monitor import store
from batchgen.monitor.records import CommitSecond
from batchgen.monitor.store import SegmentStore, list_segments, read_kind


def commits(first_s: int, n: int) -> list[dict]:
    out = []
    for t in range(first_s, first_s + n):
        c = CommitSecond(t)
        c.num_commits, c.num_rows = 1, t
        out.append(c.record("run-a"))
    return out


def test_segments_are_closed_files_named_by_sequence(tmp_path):
    s = SegmentStore(tmp_path)
    s.append("commits", commits(100, 3))
    s.append("commits", commits(103, 2))
    s.append("commits", [])  # nothing to write: no file
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["commits-00000001-00000001.parquet", "commits-00000002-00000002.parquet"]
    for p in tmp_path.iterdir():
        pq.read_table(p)  # each one complete on its own (footer written, file closed)
    assert read_kind(tmp_path, "commits")["time_s"].to_pylist() == list(range(100, 105))
    # a resumed run continues the sequence
    assert SegmentStore(tmp_path).next_seq["commits"] == 3


def test_merge_keeps_every_record_once_and_bounds_the_file_count(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "MERGE_SEGMENTS", 4)
    s = SegmentStore(tmp_path)
    for i in range(10):
        s.append("commits", commits(10 * i, 2))
    segs = list_segments(tmp_path, "commits")
    assert [(g.first, g.last) for g in segs] == [(1, 4), (5, 8), (9, 9), (10, 10)]
    assert len(list(tmp_path.iterdir())) == 4
    table = read_kind(tmp_path, "commits")
    assert table["time_s"].to_pylist() == [10 * i + j for i in range(10) for j in range(2)]


def test_a_kill_between_merge_and_delete_shows_no_record_twice(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "MERGE_SEGMENTS", 3)
    s = SegmentStore(tmp_path)
    s.append("commits", commits(0, 1))
    s.append("commits", commits(1, 1))
    kept = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    s.append("commits", commits(2, 1))  # merges 1..3
    for name, data in kept.items():  # as if killed before the small files were deleted
        (tmp_path / name).write_bytes(data)
    assert read_kind(tmp_path, "commits")["time_s"].to_pylist() == [0, 1, 2]


def test_temp_files_of_a_killed_write_are_removed_and_bad_files_skipped(tmp_path, caplog):
    (tmp_path / ".steps-00000001-00000001.parquet.tmp").write_bytes(b"PAR1 half")
    s = SegmentStore(tmp_path)
    assert not list(tmp_path.glob(".*"))
    s.append("commits", commits(0, 2))
    (tmp_path / "commits-00000002-00000002.parquet").write_bytes(b"not parquet")
    with caplog.at_level("WARNING"):
        assert read_kind(tmp_path, "commits").num_rows == 2
    assert "unreadable metrics file" in caplog.text


@pytest.mark.parametrize("kind", ["steps", "rows", "commits"])
def test_reading_nothing_gives_an_empty_table_of_the_schema(tmp_path, kind):
    table = read_kind(tmp_path / "absent", kind)
    assert table.num_rows == 0 and "time_s" in table.column_names


def test_the_window_column_is_read_under_its_old_name_and_merged_into_the_new(tmp_path, monkeypatch):
    """Files an earlier batchgen wrote call the planning window's column "shard"; a resumed job
    appends files that call it "window", and merges both."""
    from batchgen.monitor.records import RowsSecond

    def rows(first_s: int, window: int) -> list[dict]:
        return [RowsSecond(first_s, window, "static").record("run-a")]

    monkeypatch.setattr(store, "MERGE_SEGMENTS", 3)
    s = SegmentStore(tmp_path)
    s.append("rows", rows(0, 7))
    s.append("rows", rows(1, 8))
    for path in tmp_path.iterdir():  # as the version before wrote them
        table = pq.read_table(path)
        pq.write_table(table.rename_columns(["shard" if c == "window" else c for c in table.column_names]), path)
    assert "window" not in pq.read_schema(tmp_path / "rows-00000001-00000001.parquet").names
    assert read_kind(tmp_path, "rows")["window"].to_pylist() == [7, 8]
    assert read_kind(tmp_path, "rows", columns=["time_s", "window"]).to_pylist() == [
        {"time_s": 0, "window": 7}, {"time_s": 1, "window": 8}]
    s = SegmentStore(tmp_path)  # the resume
    s.append("rows", rows(2, 9))  # the third small file: merged with the two old ones
    assert [(g.first, g.last) for g in list_segments(tmp_path, "rows")] == [(1, 3)]
    assert pq.read_table(tmp_path / "rows-00000001-00000003.parquet")["window"].to_pylist() == [7, 8, 9]
