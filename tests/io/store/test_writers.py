"""batchgen.io.store.writers: explicit schemas, atomic part commits, and what a failed write leaves behind."""

from __future__ import annotations

import errno
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.errors import OutputError
from batchgen.io.store import local_files, writers
from batchgen.io.store.schema import OUTPUT_FIXED_FIELDS, output_schema
from batchgen.io.store.writers import PartWriter, check_output_dir

ID_FIELD = pa.field("row_id", pa.string())
PASSTHROUGH = [pa.field("topic", pa.string()), pa.field("year", pa.int64())]


def make_rows(start, num_rows):
    return [
        {"row_id": f"docs.parquet:{i}", "generated_text": f"out {i}", "finish_reason": "stop",
         "num_prompt_tokens": 10 + i, "num_generated_tokens": i, "error": None,
         "prompt_hash": f"{i:016x}", "prompt_truncated": False, "topic": f"topic {i}", "year": 2000 + i}
        for i in range(start, start + num_rows)
    ]


@pytest.fixture
def writer(tmp_path):
    return PartWriter(tmp_path / "out", output_schema(ID_FIELD, PASSTHROUGH))


def test_output_schema_order_and_types():
    schema = output_schema(ID_FIELD, PASSTHROUGH)
    assert schema.names == ["row_id", "generated_text", "finish_reason", "num_prompt_tokens",
                            "num_generated_tokens", "error", "prompt_hash", "prompt_truncated", "topic", "year"]
    assert [f.type for f in OUTPUT_FIXED_FIELDS] == [pa.string(), pa.string(), pa.int32(), pa.int32(),
                                                     pa.string(), pa.string(), pa.bool_()]
    # directories begun before the prompt_hash column keep their schema
    assert "prompt_hash" not in output_schema(ID_FIELD, PASSTHROUGH, with_prompt_hash=False).names


def test_output_schema_asserts_on_collision():
    with pytest.raises(AssertionError, match="collide"):
        output_schema(ID_FIELD, [pa.field("error", pa.string())])


def test_round_trip_and_names_sort_in_write_order(write_part, writer):
    writer.out_dir.mkdir()
    first = write_part(writer, make_rows(0, 3))
    # a Table with other column order and wider ints is cast to the explicit schema
    table = pa.Table.from_pylist(make_rows(3, 2)).select(["year", *writer.schema.names[:-1]])
    second = write_part(writer, table)
    assert first.name.startswith("part-00000-") and second.name.startswith("part-00001-")
    assert sorted(p.name for p in writer.out_dir.iterdir()) == [first.name, second.name]  # no temp files
    assert pq.read_schema(first) == writer.schema == pq.read_schema(second)
    rows = pq.read_table(first).to_pylist() + pq.read_table(second).to_pylist()
    assert rows == make_rows(0, 5)


def test_missing_keys_are_null_and_unknown_columns_are_refused(write_part, writer):
    writer.out_dir.mkdir()
    path = write_part(writer, [{"row_id": "a:0", "finish_reason": "error", "error": "prompt too long"}])
    row = pq.read_table(path).to_pylist()[0]
    assert row["error"] == "prompt too long" and row["generated_text"] is None
    with pytest.raises(ValueError, match="not in the output schema: \\['surprise'\\]"):
        write_part(writer, [{"row_id": "a:1", "surprise": 1}])
    with pytest.raises(ValueError, match="do not match the output schema"):
        write_part(writer, pa.table({"row_id": ["a:2"]}))


def test_sequence_continues_after_existing_parts_with_unique_names(write_part, writer):
    writer.out_dir.mkdir()
    first = write_part(writer, make_rows(0, 1))
    resumed = PartWriter(writer.out_dir, writer.schema)  # a resumed run, or a second process
    assert resumed.next_seq == 1
    second = write_part(resumed, make_rows(1, 1))
    other = write_part(PartWriter(writer.out_dir, writer.schema, prefix="part"), make_rows(2, 1))
    assert second.name.startswith("part-00001-") and other.name.startswith("part-00002-")
    assert len({first.name, second.name, other.name}) == 3


def test_dataset_reads_committed_parts_and_ignores_bookkeeping(write_part, writer):
    writer.out_dir.mkdir()
    for start in (0, 4, 8):
        write_part(writer, make_rows(start, 4))
    (writer.out_dir / "_manifest.json").write_text('{"parts": []}')
    (writer.out_dir / ".part-00003-deadbeef.parquet.tmp").write_bytes(b"PAR1 half a part")
    table = ds.dataset(writer.out_dir, format="parquet").to_table()
    assert table.schema == writer.schema
    assert sorted(table.to_pylist(), key=lambda r: r["year"]) == make_rows(0, 12)


@pytest.mark.parametrize("stage", ["write", "fsync", "rename", "fsync_dir"])
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
def test_injected_os_error_leaves_nothing_partial(write_part, writer, monkeypatch, stage, error):
    writer.out_dir.mkdir()
    committed = write_part(writer, make_rows(0, 2))
    seen_at_fault = []

    def fault(current):
        if current == stage:
            seen_at_fault.extend(sorted(p.name for p in writer.out_dir.iterdir()))
            raise OSError(error, os.strerror(error))

    monkeypatch.setattr(local_files, "_fault_hook", fault)
    with pytest.raises(OutputError) as info:
        write_part(writer, make_rows(2, 2))
    assert os.strerror(error) in str(info.value) and str(writer.out_dir / "part-00001-") in str(info.value)
    assert info.value.exit_code == 2
    assert len(seen_at_fault) == 2  # the temp (or, at fsync_dir, the renamed) file existed at the fault
    assert [p.name for p in writer.out_dir.iterdir()] == [committed.name]
    assert ds.dataset(writer.out_dir, format="parquet").to_table().to_pylist() == make_rows(0, 2)
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert write_part(writer, make_rows(2, 2)).name.startswith("part-00001-")  # the caller may retry


def test_disk_full_in_the_middle_of_the_parquet_write(write_part, writer, monkeypatch):
    writer.out_dir.mkdir()
    real_write_table = pq.write_table

    def write_half_then_fail(table, file, **kwargs):
        real_write_table(table.slice(0, 1), file, **kwargs)  # some bytes reach the temp file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writers.pq, "write_table", write_half_then_fail)
    with pytest.raises(OutputError, match="No space left on device"):
        write_part(writer, make_rows(0, 3))
    assert list(writer.out_dir.iterdir()) == []


def test_interrupt_during_write_leaves_no_temp_file(write_part, writer, monkeypatch):
    writer.out_dir.mkdir()

    def interrupt(stage):
        if stage == "fsync":
            raise KeyboardInterrupt

    monkeypatch.setattr(local_files, "_fault_hook", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_part(writer, make_rows(0, 1))
    assert list(writer.out_dir.iterdir()) == []


def test_writing_into_a_vanished_directory_is_an_output_error(write_part, writer):
    with pytest.raises(OutputError, match="No such file or directory"):
        write_part(writer, make_rows(0, 1))


def test_check_output_dir_creates_parents(tmp_path):
    path = check_output_dir(tmp_path / "a" / "b")
    assert path.is_dir() and list(path.iterdir()) == []  # the write probe is gone


def test_check_output_dir_refuses_a_file(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(OutputError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "taken")
    with pytest.raises(OutputError, match="cannot create output directory"):
        check_output_dir(tmp_path / "taken" / "sub")


def test_check_output_dir_refuses_an_unwritable_dir(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.geteuid() == 0:
            # root writes through permission bits, so chmod cannot show the failure here;
            # simulate what os.access reports for an ordinary user instead.
            monkeypatch.setattr(os, "access", lambda path, mode: False)
        with pytest.raises(OutputError, match="output directory is not writable"):
            check_output_dir(locked)
    finally:
        locked.chmod(0o700)


def test_check_output_dir_probe_catches_what_os_access_misses(tmp_path, monkeypatch):
    def read_only_fs(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(writers.Path, "touch", read_only_fs)
    with pytest.raises(OutputError, match="not writable.*Read-only file system"):
        check_output_dir(tmp_path)
