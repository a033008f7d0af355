"""batchgen.io.inputs.readers on real files: resolution, streaming, and every input error a user can make."""

from __future__ import annotations

import gzip
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.errors import InputError
from batchgen.io.inputs.discovery import resolve_inputs
from batchgen.io.inputs.readers import holds_no_rows, iter_batches, read_columns, read_schema


def write_parquet(path, num_rows=10, row_group_size=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(num_rows)), "text": [f"t{i}" for i in range(num_rows)],
                      "score": [i / 2 for i in range(num_rows)]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path, records, *, tail=b""):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def read_all(file, columns=None, batch_size=4):
    return pa.Table.from_batches(list(iter_batches(file, columns, batch_size))).to_pylist()


def only_file(path):
    (file,) = resolve_inputs([str(path)])
    return file


# ---------------------------------------------------------------- resolving


def test_parquet_file_reads_footer(tmp_path):
    file = only_file(write_parquet(tmp_path / "a.parquet", num_rows=7))
    assert (file.format, file.num_rows) == ("parquet", 7)
    assert file.path == str(tmp_path / "a.parquet")
    assert read_columns(file) == ["id", "text", "score"]


def test_directory_is_recursive_sorted_and_skips_bookkeeping(tmp_path):
    write_parquet(tmp_path / "b.parquet")
    write_jsonl(tmp_path / "a.jsonl", [{"x": 1}])
    write_jsonl(tmp_path / "sub" / "c.jsonl.gz", [{"x": 1}])
    write_parquet(tmp_path / "_tmp" / "hidden.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".d.parquet.tmp").write_bytes(b"partial")
    (tmp_path / ".e.parquet").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "meta.json").write_text("{}")  # .json only when named: directories hold configs
    files = resolve_inputs([str(tmp_path)])
    assert [s.path for s in files] == [str(tmp_path / n) for n in ("a.jsonl", "b.parquet", "sub/c.jsonl.gz")]
    assert [s.format for s in files] == ["jsonl", "parquet", "jsonl"]
    assert files[0].num_rows is None


def test_glob_order_relative_paths_and_dedup(tmp_path, monkeypatch):
    for name in ("b1.parquet", "a.parquet", "b0.parquet"):
        write_parquet(tmp_path / "d" / name)
    (tmp_path / "d" / "b9.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    files = resolve_inputs(["d/b*", "d/*.parquet", "./d/a.parquet"])
    expected = [str(tmp_path / "d" / n) for n in ("b0.parquet", "b1.parquet", "a.parquet")]
    assert [s.path for s in files] == expected


def test_double_star_glob_and_glob_matching_directories(tmp_path):
    write_parquet(tmp_path / "x" / "2024" / "p.parquet")
    write_parquet(tmp_path / "x" / "2025" / "deep" / "q.parquet")
    write_parquet(tmp_path / "x" / "_staging" / "r.parquet")
    deep = resolve_inputs([str(tmp_path / "x" / "**" / "*.parquet")])
    expected = [str(tmp_path / "x/2024/p.parquet"), str(tmp_path / "x/2025/deep/q.parquet")]
    assert [s.path for s in deep] == expected
    dirs = resolve_inputs([str(tmp_path / "x" / "20*")])
    assert [s.path for s in dirs] == [s.path for s in deep]


def test_file_uri_goes_through_pyarrow_filesystem(tmp_path):
    write_parquet(tmp_path / "a.parquet", num_rows=3)
    write_jsonl(tmp_path / "b.jsonl", [{"x": 1}])
    files = resolve_inputs([f"file://{tmp_path}/*"])
    assert [s.path for s in files] == [f"file://{tmp_path}/a.parquet", f"file://{tmp_path}/b.jsonl"]
    assert read_all(files[0], ["id"]) == [{"id": 0}, {"id": 1}, {"id": 2}]
    assert read_all(files[1]) == [{"x": 1}]


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("missing.parquet", "no such file"),
        ("nothing-*.parquet", "matched no files"),
        ("data.csv", "unsupported file type (supported: .parquet, .jsonl, .jsonl.gz, .json)"),
        ("only-txt/*", "no input files (supported: .parquet"),
        ("empty-dir", "directory has no input files"),
    ],
)
def test_resolve_errors_name_the_path(tmp_path, pattern, message):
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "only-txt").mkdir()
    (tmp_path / "only-txt" / "readme.txt").write_text("")
    (tmp_path / "empty-dir" / "sub").mkdir(parents=True)
    with pytest.raises(InputError, match="matched no files|no such|unsupported|no input") as info:
        resolve_inputs([str(tmp_path / pattern)])
    assert message in str(info.value) and str(tmp_path / pattern) in str(info.value)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated_footer"])
def test_corrupt_parquet_fails_at_resolve(tmp_path, damage):
    path = write_parquet(tmp_path / "bad.parquet", num_rows=50)
    data = path.read_bytes()
    path.write_bytes(b"not parquet at all" * 20 if damage == "garbage" else data[:-10])
    with pytest.raises(InputError, match="not a valid Parquet file") as info:
        resolve_inputs([str(tmp_path)])
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name", ["empty.parquet", "empty.jsonl"])
def test_zero_byte_file_holds_no_rows(tmp_path, name):
    """An empty partition of a scheduled job: no rows and no columns, whatever the format."""
    (tmp_path / name).write_bytes(b"")
    file = only_file(tmp_path / name)
    assert holds_no_rows(file) and read_columns(file) == []
    assert list(iter_batches(file, ["text"], 8)) == []


def test_zero_row_parquet_yields_nothing(tmp_path):
    path = tmp_path / "zero.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    file = only_file(path)
    assert file.num_rows == 0 and list(iter_batches(file, ["text"], 8)) == []


def test_blank_only_jsonl_holds_no_rows(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n  \n\n")
    file = only_file(path)
    assert holds_no_rows(file) and read_columns(file) == [] and list(iter_batches(file, ["text"], 8)) == []
    (tmp_path / "one.jsonl").write_text('\n{"text": "a"}\n')
    assert not holds_no_rows(only_file(tmp_path / "one.jsonl"))


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.gz"])
def test_batches_are_bounded_and_keep_file_order(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        write_parquet(path, num_rows=23, row_group_size=7)  # row groups cut across batches
    else:
        write_jsonl(path, [{"id": i, "text": f"t{i}", "score": i / 2} for i in range(23)])
    file = only_file(path)
    batches = list(iter_batches(file, None, batch_size=5))
    assert all(0 < b.num_rows <= 5 for b in batches)
    rows = pa.Table.from_batches(batches).to_pylist()
    assert [r["id"] for r in rows] == list(range(23)) and rows[3] == {"id": 3, "text": "t3", "score": 1.5}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_column_projection_in_requested_order(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        write_parquet(path, num_rows=3)
    else:
        write_jsonl(path, [{"id": i, "text": f"t{i}", "score": i / 2} for i in range(3)])
    batches = list(iter_batches(only_file(path), ["text", "id"], 2))
    assert all(b.schema.names == ["text", "id"] for b in batches)
    assert pa.Table.from_batches(batches).to_pylist()[2] == {"text": "t2", "id": 2}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_missing_column_lists_existing_ones(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        write_parquet(path)
    else:
        write_jsonl(path, [{"id": 1, "text": "a", "score": 0.5}])
    with pytest.raises(InputError) as info:
        iter_batches(only_file(path), ["text", "prompt"], 4)  # raises before iteration
    message = str(info.value)
    assert str(path) in message and "column 'prompt'" in message
    assert "'id', 'text', 'score'" in message and info.value.column == "prompt"


def test_jsonl_blank_lines_missing_keys_and_key_union(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"a": 1}\n\n   \n{"b": "x"}\r\n{"a": 3, "b": "z"}\n')
    file = only_file(path)
    assert read_columns(file) == ["a", "b"]
    assert read_all(file) == [{"a": 1, "b": None}, {"a": None, "b": "x"}, {"a": 3, "b": "z"}]
    assert read_schema(file) == pa.schema([("a", pa.int64()), ("b", pa.string())])


def test_jsonl_mixed_types_become_json_text(tmp_path):
    records = [
        {"mixed": 1, "num": 1, "flag": True, "nested": {"k": [1, 2]}, "big": 2**60},
        {"mixed": "two", "num": 2.5, "flag": False, "nested": [1, "a"], "big": 3},
        {"mixed": {"three": 3}, "num": None, "flag": None, "nested": None, "big": None},
        {"mixed": True, "num": -4, "flag": True, "nested": "plain", "big": 1},
    ]
    file = only_file(write_jsonl(tmp_path / "mixed.jsonl", records))
    assert read_schema(file) == pa.schema([("mixed", pa.string()), ("num", pa.float64()),
                                            ("flag", pa.bool_()), ("nested", pa.string()),
                                            ("big", pa.int64())])
    rows = read_all(file, batch_size=2)
    assert [r["mixed"] for r in rows] == ["1", "two", '{"three": 3}', "true"]
    assert [r["num"] for r in rows] == [1.0, 2.5, None, -4.0]
    assert [r["nested"] for r in rows] == ['{"k": [1, 2]}', '[1, "a"]', None, "plain"]
    assert rows[0]["big"] == 2**60  # exact: int64 column, no float rounding


def test_jsonl_late_value_that_does_not_fit_names_row_and_column(tmp_path, monkeypatch):
    monkeypatch.setattr("batchgen.io.inputs.jsonl.JSONL_SCHEMA_SAMPLE_RECORDS", 3)
    path = write_jsonl(tmp_path / "late.jsonl", [{"n": i} for i in range(5)] + [{"n": "five"}])
    with pytest.raises(InputError, match=r"row 5, column 'n': a JSON string does not fit column type int64"):
        read_all(only_file(path), batch_size=2)


def test_jsonl_keys_after_the_sample_warn_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("batchgen.io.inputs.jsonl.JSONL_SCHEMA_SAMPLE_RECORDS", 2)
    path = write_jsonl(tmp_path / "late.jsonl", [{"a": 1}, {"a": 2}, {"a": 3, "b": 1}, {"a": 4, "b": 2}])
    with caplog.at_level(logging.WARNING):
        assert read_all(only_file(path)) == [{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}]
    warnings = [r.getMessage() for r in caplog.records if "absent" in r.getMessage()]
    assert len(warnings) == 1 and "row 2 has keys ['b'] absent from the first 2 records" in warnings[0]


@pytest.mark.parametrize(
    ("content", "row", "message"),
    [
        (b'{"a": 1}\n\n{"a": 2\n{"a": 3}\n', 1, "malformed JSON .* on line 3"),
        (b'{"a": 1}\n[1, 2]\n', 1, "line 2 holds a JSON array, not an object"),
        (b'{"a": 1}\n{"a": 2}\n"text"\n', 2, "line 3 holds a JSON string"),
        (b'{"a": "ok"}\n{"a": "caf\xe9"}\n{"a": "x"}\n', 1, "invalid UTF-8 at byte 10 on line 2"),
    ],
)
def test_bad_jsonl_line_names_file_row_and_line(tmp_path, content, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message) as info:
        read_all(only_file(path), batch_size=1)
    assert info.value.row == row and info.value.path == str(path)
    assert str(info.value).startswith(f"{path}, row {row}: ")


def test_malformed_line_found_after_the_sample(tmp_path, monkeypatch):
    monkeypatch.setattr("batchgen.io.inputs.jsonl.JSONL_SCHEMA_SAMPLE_RECORDS", 2)
    path = write_jsonl(tmp_path / "bad.jsonl", [{"a": i} for i in range(4)], tail=b"{oops\n")
    with pytest.raises(InputError, match="row 4: malformed JSON"):
        read_all(only_file(path))


@pytest.mark.parametrize("tail", [b'{"a": 99, "b": "cut', b'{"a": "caf\xc3'])
def test_truncated_last_line_is_skipped_with_a_warning(tmp_path, caplog, tail):
    path = write_jsonl(tmp_path / "killed.jsonl", [{"a": 1}, {"a": 2}], tail=tail)
    with caplog.at_level(logging.WARNING, logger="batchgen.io.inputs.jsonl"):
        assert read_all(only_file(path)) == [{"a": 1}, {"a": 2}]
    messages = [r.getMessage() for r in caplog.records]
    assert any("truncated last line 3" in m and str(path) in m for m in messages)


def test_unterminated_but_valid_last_line_is_kept(tmp_path):
    path = tmp_path / "no-newline.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}')
    assert read_all(only_file(path)) == [{"a": 1}, {"a": 2}]


def test_bom_and_dot_json(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    assert read_all(only_file(path)) == [{"a": 1}, {"a": 2}]
    (tmp_path / "array.json").write_text('[{"a": 1}]')
    with pytest.raises(InputError, match=r"not an object \(\.json files are read as JSON Lines\)"):
        read_columns(only_file(tmp_path / "array.json"))


def test_corrupt_gzip_is_an_input_error(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"a": 1}\n' * 1000)[:-40])
    with pytest.raises(InputError, match="read failed") as info:
        read_all(only_file(path))
    assert info.value.path == str(path)


def test_parquet_batch_size_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        iter_batches(only_file(write_parquet(tmp_path / "a.parquet")), None, 0)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False), st.text(max_size=8))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(scalars, st.lists(scalars, max_size=2)), min_size=1, max_size=12))
def test_jsonl_values_are_never_lost(tmp_path_factory, values):
    """Whatever kinds a column mixes, each value reads back equal, or as its exact JSON text."""
    path = write_jsonl(tmp_path_factory.mktemp("prop") / "v.jsonl", [{"v": v} for v in values])
    got_values = [r["v"] for r in read_all(only_file(path), batch_size=5)]
    for value, got in zip(values, got_values, strict=True):
        if isinstance(got, str) and not isinstance(value, str):
            assert json.loads(got) == value
        else:  # exact comparison: an int read back as a rounded float would fail here
            assert got == value
