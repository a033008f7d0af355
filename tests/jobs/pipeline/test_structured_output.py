"""Structured output through run_job on the tiny random Llama: JSON-schema, choices and regex jobs,
a per-row schema column (a bad schema is that row's error, the job goes on), the json_valid column,
and a resume under a changed constraint refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config

TEXTS = ["one prompt", "another prompt", "a third, longer prompt than the others", "four", "fifth row here"]
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["bug", "feature", "question"]},
                                           "urgent": {"type": "boolean"}},
          "required": ["label", "urgent"], "additionalProperties": False}


def _input(tmp_path, **columns):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS, **columns}), src)
    return src


def _run(tmp_path, loaded, tiny_model_dir, out_name="out", **settings):
    out = tmp_path / out_name
    run_job(tiny_job_config(_input(tmp_path, **settings.pop("columns", {})), out, tiny_model_dir, id_column="id",
                            chat=False, **({"max_new_tokens": 48} | settings)), loaded=loaded)
    return out, committed_rows(out)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0}], ids=["greedy", "sampled"])
def test_json_schema_job_rows_all_parse_and_validate(tmp_path, loaded, tiny_model_dir, one_thread, sampling):
    out, rows = _run(tmp_path, loaded, tiny_model_dir, json_schema=json.dumps(SCHEMA), **sampling)
    assert len(rows) == len(TEXTS)
    for row in rows.values():
        assert row["finish_reason"] == "stop" and row["json_valid"] is True, row
        jsonschema.validate(json.loads(row["generated_text"]), SCHEMA)


def test_schema_file_and_length_cut_is_never_valid(tmp_path, loaded, tiny_model_dir, one_thread):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    _, rows = _run(tmp_path, loaded, tiny_model_dir, json_schema=str(path), max_new_tokens=4)
    for row in rows.values():
        assert row["finish_reason"] == "length" and row["json_valid"] is False


def test_choices_and_regex_jobs(tmp_path, loaded, tiny_model_dir, one_thread):
    choices = ["positive", "negative", "mixed feelings"]
    out, rows = _run(tmp_path, loaded, tiny_model_dir, choices=",".join(choices))
    assert all(r["generated_text"] in choices and r["finish_reason"] == "stop" for r in rows.values())
    assert "json_valid" not in pq.read_schema(next(out.rglob("part-*.parquet"))).names  # no JSON constraint
    pattern = r"[A-Z]{2}-[0-9]{2,4}"
    _, rows = _run(tmp_path, loaded, tiny_model_dir, out_name="out-regex", regex=pattern)
    assert all(re.fullmatch(pattern, r["generated_text"]) for r in rows.values()), rows


def test_per_row_schema_column(tmp_path, loaded, tiny_model_dir, one_thread):
    other = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["n"], "additionalProperties": False}
    schemas = [json.dumps(SCHEMA), json.dumps(other), '{"type": "nonsense"}', None, "not json"]
    _, rows = _run(tmp_path, loaded, tiny_model_dir, json_schema_column="schema", columns={"schema": schemas})
    for i in (0, 1):
        assert rows[i]["json_valid"] is True, rows[i]
        jsonschema.validate(json.loads(rows[i]["generated_text"]), json.loads(schemas[i]))
    for i in (2, 4):
        assert rows[i]["finish_reason"] == "error" and "'schema'" in rows[i]["error"], rows[i]
        assert "in.parquet" in rows[i]["error"] and f"row {i}" in rows[i]["error"], rows[i]["error"]
    assert rows[3]["json_valid"] is None and rows[3]["finish_reason"] in ("stop", "length")  # no constraint


def test_resume_with_another_constraint_is_refused(tmp_path, loaded, tiny_model_dir, one_thread):
    _run(tmp_path, loaded, tiny_model_dir, choices="yes,no")
    with pytest.raises(BatchgenError, match="choices"):
        _run(tmp_path, loaded, tiny_model_dir, choices="yes,no,maybe")


def test_sigterm_continuation_keeps_the_constraint(tmp_path, loaded, tiny_model_dir, one_thread, monkeypatch):
    """Stopped by SIGTERM with rows in flight, then resumed: the continued rows replay their tokens into a
    fresh grammar and end as the uninterrupted run's rows do, every one valid."""
    import os
    import signal

    from batchgen.engine.engine import LLMEngine
    from batchgen.errors import JobInterrupted

    settings = dict(json_schema=json.dumps(SCHEMA), batch_size=2, commit_every_rows=1000, stop_grace_s=0,
                    temperature=1.0)
    _, reference = _run(tmp_path, loaded, tiny_model_dir, out_name="ref", **settings)
    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 8:  # mid-row: the first batch's JSON is half written
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    with pytest.raises(JobInterrupted):
        _run(tmp_path, loaded, tiny_model_dir, out_name="stopped", **settings)
    monkeypatch.setattr(LLMEngine, "step", real_step)
    out = tmp_path / "stopped"
    summary = run_job(tiny_job_config(tmp_path / "in.parquet", out, tiny_model_dir, id_column="id", chat=False,
                                      max_new_tokens=48, **settings), loaded=loaded)
    assert summary.num_rows_continued >= 1
    rows = committed_rows(out)
    assert {k: r["generated_text"] for k, r in rows.items()} == {k: r["generated_text"] for k, r in reference.items()}
    assert all(r["json_valid"] is True for r in rows.values())


def test_jump_forward_keeps_the_rows_and_counts_forced_tokens(tmp_path, loaded, tiny_model_dir, one_thread):
    texts = {}
    for jump_forward in (True, False):
        out = tmp_path / f"out-{jump_forward}"
        summary = run_job(tiny_job_config(_input(tmp_path), out, tiny_model_dir, id_column="id", chat=False,
                                          max_new_tokens=48, json_schema=json.dumps(SCHEMA),
                                          jump_forward=jump_forward), loaded=loaded)
        texts[jump_forward] = {k: r["generated_text"] for k, r in committed_rows(out).items()}
        forced = summary.engine["num_forced_tokens"]
        assert (forced > 0) == jump_forward
        assert ("forced tokens (decode steps saved" in "\n".join(summary.lines())) == jump_forward
    assert texts[True] == texts[False]
