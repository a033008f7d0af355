"""RowSource: up-front column checks, stable derived ids, passthrough columns, --max-rows."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from batchgen.config.job import build_config
from batchgen.errors import ConfigError, InputError
from batchgen.jobs.rows.rows import DERIVED_ID_COLUMN, RowSource
from tests.test_cli import write_jsonl, write_parquet


def _open(tmp_path, inputs, **overrides) -> RowSource:
    config = build_config(None, inputs=[str(p) for p in inputs], output=str(tmp_path / "out"), **overrides)
    return RowSource.open(config)


def test_derived_ids_are_file_name_and_row_index(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", text=["x", "y", "z"])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "p"}, {"text": "q"}])
    source = _open(tmp_path, [a, b], read_batch_size=2)  # indices continue across record batches
    rows = list(source)
    assert [r.row_id for r in rows] == ["a.parquet:0", "a.parquet:1", "a.parquet:2", "b.jsonl:0", "b.jsonl:1"]
    assert [r.row_index for r in rows] == [0, 1, 2, 0, 1]
    assert [r.values["text"] for r in rows] == ["x", "y", "z", "p", "q"]
    assert source.id_field == pa.field(DERIVED_ID_COLUMN, pa.string())
    # the same inputs give the same ids again
    assert [r.row_id for r in _open(tmp_path, [a, b])] == [r.row_id for r in rows]


def test_repeated_file_names_get_path_based_ids(tmp_path):
    one = write_parquet(tmp_path / "2024" / "part.parquet", text=["a", "b"])
    two = write_parquet(tmp_path / "2025" / "part.parquet", text=["c"])
    other = write_parquet(tmp_path / "2025" / "extra.parquet", text=["d"])
    rows = list(_open(tmp_path, [tmp_path]))  # a directory, walked recursively
    ids = [r.row_id for r in rows]
    # sorted by path; the repeated name gets its full path, the unique one keeps its short label
    assert ids == [f"{os.path.abspath(one)}:0", f"{os.path.abspath(one)}:1", "extra.parquet:0",
                   f"{os.path.abspath(two)}:0"]
    assert len(set(ids)) == len(ids)
    assert [r.values["text"] for r in rows] == ["a", "b", "d", "c"]
    assert other.name == "extra.parquet"


def test_id_column_gives_the_ids(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", doc_id=[10, 20, 30], text=["a", "b", "c"], lang=["en", "de", "fr"])
    source = _open(tmp_path, [path], id_column="doc_id")
    assert [r.row_id for r in source] == [10, 20, 30]
    assert source.id_field == pa.field("doc_id", pa.int64())
    # the id column is the output's id, so it is not passed through a second time
    assert [f.name for f in source.passthrough_fields] == ["text", "lang"]


def test_null_id_is_an_input_error(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", doc_id=["a", None], text=["x", "y"])
    with pytest.raises(InputError, match=r"in.parquet, row 1, column 'doc_id': id is null"):
        list(_open(tmp_path, [path], id_column="doc_id"))


def test_passthrough_is_every_column_or_keep_columns(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", text=["a"], title=["t"], lang=["en"], n=[1])
    assert [f.name for f in _open(tmp_path, [path]).passthrough_fields] == ["text", "title", "lang", "n"]
    source = _open(tmp_path, [path], keep_columns=["lang", "title"], template="{title}: {text}")
    assert [f.name for f in source.passthrough_fields] == ["lang", "title"]
    # read: the template's columns and the kept ones, nothing else
    assert set(source.read_columns) == {"text", "title", "lang"}
    row = next(iter(source))
    assert row.values == {"title": "t", "text": "a", "lang": "en"}


def test_missing_prompt_column_lists_the_columns(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", body=["a"], title=["t"])
    with pytest.raises(InputError) as info:
        _open(tmp_path, [path])
    message = str(info.value)
    assert "prompt column 'text' not found" in message
    assert "columns: body, title" in message
    assert str(path) in message


def test_template_naming_a_missing_column(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", text=["a"])
    with pytest.raises(ConfigError, match=r"template names column 'title', which does not exist; columns: text"):
        _open(tmp_path, [path], template="{title}: {text}")


@pytest.mark.parametrize(("flag", "overrides"), [
    ("--id-column", dict(id_column="doc_id")),
    ("--max-new-tokens-column", dict(max_new_tokens_column="limit")),
    ("--keep-columns", dict(keep_columns=["nope"])),
])
def test_missing_named_columns(tmp_path, flag, overrides):
    path = write_parquet(tmp_path / "in.parquet", text=["a"], other=[1])
    with pytest.raises(InputError, match=f"{flag} '.*' not found; columns: text, other"):
        _open(tmp_path, [path], **overrides)


def test_every_file_is_checked_before_any_row_is_read(tmp_path):
    good = write_parquet(tmp_path / "a.parquet", text=["a"])
    bad = write_jsonl(tmp_path / "b.jsonl", [{"body": "no text column here"}])
    with pytest.raises(InputError, match=r"b.jsonl: prompt column 'text' not found; columns: body"):
        _open(tmp_path, [good, bad])


@pytest.mark.parametrize("column", ["error", "generated_text", "finish_reason", DERIVED_ID_COLUMN])
def test_input_column_that_would_overwrite_an_output_column(tmp_path, column):
    path = write_parquet(tmp_path / "in.parquet", text=["a"], **{column: ["x"]})
    with pytest.raises(ConfigError, match=f"'{column}' would overwrite output columns"):
        _open(tmp_path, [path])
    # keeping only other columns resolves it
    assert [f.name for f in _open(tmp_path, [path], keep_columns=["text"]).passthrough_fields] == ["text"]


def test_input_files_that_disagree_on_types(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", text=["a"], n=[1])
    b = write_parquet(tmp_path / "b.parquet", text=["b"], n=[[1, 2]])
    with pytest.raises(InputError, match="input files must agree on column types") as e:
        _open(tmp_path, [a, b])
    assert str(a) in str(e.value) and str(b) in str(e.value) and "'n'" in str(e.value)  # names both files


def test_max_rows_spans_files(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", text=["a0", "a1", "a2"])
    b = write_parquet(tmp_path / "b.parquet", text=["b0", "b1", "b2"])
    source = _open(tmp_path, [a, b], max_rows=4, read_batch_size=2)
    assert source.num_rows == 4
    assert [r.row_id for r in source] == ["a.parquet:0", "a.parquet:1", "a.parquet:2", "b.parquet:0"]
    assert _open(tmp_path, [a, b]).num_rows == 6
    assert _open(tmp_path, [a, b], max_rows=100).num_rows == 6
    empty = _open(tmp_path, [a, b], max_rows=0)
    assert empty.num_rows == 0 and list(empty) == []


def test_jsonl_row_count_is_unknown_until_read(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": str(i)} for i in range(5)])
    assert _open(tmp_path, [path]).num_rows is None
    source = _open(tmp_path, [path], max_rows=2)
    assert source.num_rows == 2
    assert [r.values["text"] for r in source] == ["0", "1"]


def test_numbers_in_a_prompt_column_are_text_in_either_format(tmp_path):
    """A JSON Lines number is read as text; a Parquet number is too, a decimal as its digits as stored
    (not an error row 'holds a Decimal, not text': a decimal id or amount is text to a prompt)."""
    from decimal import Decimal

    from batchgen.jobs.prompting.template import Template

    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": 12345}, {"text": 7}])
    ints = write_parquet(tmp_path / "i.parquet", text=pa.array([12345, 7], pa.int64()))
    decimals = write_parquet(tmp_path / "d.parquet",
                             text=pa.array([Decimal("12345"), Decimal("2.50")], pa.decimal128(9, 2)))
    template = Template("Q: {text}", "text")
    for path, expected in ((jsonl, ["12345", "7"]), (ints, ["12345", "7"]), (decimals, ["12345.00", "2.50"])):
        rows = list(_open(tmp_path, [path]))
        assert [r.error for r in rows] == [None, None], path
        assert [template.render(r.values) for r in rows] == [f"Q: {e}" for e in expected]
