"""A row's own constraint through run_job on the tiny random Llama: --constraint-column cells of each
kind (JSON text and Arrow structs), bad cells and constraints that do not compile for the tokenizer as
error rows naming file, row and column while the job goes on, and the row's constraint in its
prompt hash and the column in the fingerprint."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError, ConfigError
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["bug", "feature"]}, "urgent": {"type": "boolean"}},
          "required": ["label", "urgent"], "additionalProperties": False}
PATTERN = r"[A-Z]{2}-[0-9]{2,4}"
CHOICES = ["positive", "negative", "mixed feelings"]
CELLS = [json.dumps({"type": "regex", "pattern": PATTERN}), json.dumps({"type": "choices", "choices": CHOICES}),
         json.dumps({"type": "json_schema", "schema": SCHEMA}), json.dumps({"type": "json_object"}), None,
         json.dumps({"type": "lark", "grammar": "start: x"}), json.dumps({"type": "regex"}), "{not json",
         json.dumps({"type": "regex", "pattern": "[a-"})]


def _run(tmp_path, loaded, model_dir, cells, out_name="out", **settings):
    src = tmp_path / "in.parquet"
    texts = [f"row number {i}" for i in range(len(cells))]
    if not src.exists() or settings.pop("rewrite", False):
        pq.write_table(pa.table({"id": list(range(len(cells))), "text": texts,
                                 "constraint": pa.array(cells, settings.pop("cell_type", None))}), src)
    out = tmp_path / out_name
    summary = run_job(tiny_job_config(src, out, model_dir, id_column="id", chat=False,
                                      **({"max_new_tokens": 48, "constraint_column": "constraint"} | settings)),
                      loaded=loaded)
    return summary, committed_rows(out)


def test_each_kind_of_cell_and_bad_cells(tmp_path, loaded, tiny_model_dir, one_thread):
    _, rows = _run(tmp_path, loaded, tiny_model_dir, CELLS, temperature=1.0)
    assert re.fullmatch(PATTERN, rows[0]["generated_text"]) and rows[0]["json_valid"] is None
    assert rows[1]["generated_text"] in CHOICES and rows[1]["json_valid"] is None
    jsonschema.validate(json.loads(rows[2]["generated_text"]), SCHEMA)
    assert rows[2]["json_valid"] is True
    assert rows[3]["json_valid"] is (rows[3]["finish_reason"] == "stop")  # any object, unless cut by the budget
    assert rows[4]["error"] is None and rows[4]["json_valid"] is None  # null cell: the job's (no) constraint
    for i, reason in ((5, "type must be one of"), (6, "needs 'pattern'"), (7, "not JSON"), (8, "regex")):
        error = rows[i]["error"]
        assert rows[i]["finish_reason"] == "error", rows[i]
        assert f"in.parquet row {i}: column 'constraint' must hold a valid constraint object" in error, error
        assert reason in error, error


def test_struct_cells(tmp_path, loaded, tiny_model_dir, one_thread):
    cells = [{"type": "choices", "choices": CHOICES, "pattern": None}, {"type": "regex", "choices": None,
                                                                      "pattern": PATTERN}, None]
    _, rows = _run(tmp_path, loaded, tiny_model_dir, cells)
    assert rows[0]["generated_text"] in CHOICES and re.fullmatch(PATTERN, rows[1]["generated_text"])


def test_a_changed_cell_regenerates_its_row_only(tmp_path, loaded, tiny_model_dir, one_thread):
    cells = CELLS[:3]
    _run(tmp_path, loaded, tiny_model_dir, cells)
    changed = [cells[0], json.dumps({"type": "choices", "choices": ["yes", "no"]}), cells[2]]
    summary, rows = _run(tmp_path, loaded, tiny_model_dir, changed, rewrite=True)
    assert summary.num_rows_changed == 1 and rows[1]["generated_text"] in ("yes", "no")


def test_the_column_is_in_the_fingerprint_and_goes_alone(tmp_path, loaded, tiny_model_dir, one_thread):
    _run(tmp_path, loaded, tiny_model_dir, CELLS[:2])
    assert load_manifest(tmp_path / "out").fingerprint["constraint_column"] == "constraint"
    with pytest.raises(BatchgenError, match="committed with other settings"):
        _run(tmp_path, loaded, tiny_model_dir, CELLS[:2], constraint_column=None)
    with pytest.raises(ConfigError, match="cannot go together"):
        _run(tmp_path, loaded, tiny_model_dir, CELLS[:2], out_name="both", json_schema_column="constraint")


@pytest.mark.parametrize("column", ["constraint_column", "json_schema_column"])
def test_a_constraint_that_does_not_compile_is_its_rows_error(tmp_path, loaded, tiny_model_dir, one_thread,
                                                               uncompilable, column):
    bad = {"type": "object", "properties": {"UNCOMPILABLE": {"type": "string"}}}
    if column == "constraint_column":
        cells = [json.dumps({"type": "json_schema", "schema": SCHEMA}), json.dumps({"type": "json_schema",
                                                                                    "schema": bad})]
    else:
        cells = [json.dumps(SCHEMA), json.dumps(bad)]
    summary, rows = _run(tmp_path, loaded, tiny_model_dir, [*cells, None], **{"constraint_column": None, column:
                                                                             "constraint"})
    assert rows[0]["json_valid"] is True and rows[2]["error"] is None
    error = rows[1]["error"]
    assert rows[1]["finish_reason"] == "error" and summary.num_rows_error == 1
    assert "in.parquet row 1: column 'constraint'" in error and "does not compile" in error, error


def test_a_job_constraint_that_does_not_compile_exits_2_naming_its_flag(tmp_path, loaded, tiny_model_dir,
                                                                        uncompilable):
    with pytest.raises(ConfigError, match=r"--regex \(YAML regex\) does not compile"):
        _run(tmp_path, loaded, tiny_model_dir, [None], constraint_column=None, regex="UNCOMPILABLE[0-9]")
