"""The prompt_truncated output column: which rows' prompts were cut to fit. A directory
begun before the column resumes and compacts without it, so its parts stay one table."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.durability.session import OutputSession
from tests.jobs.helpers import committed_rows, tiny_job_config

TEXTS = ["short", "x" * 200, "y" * 57, None, "medium " * 3]  # context 64 - 8 new tokens = 56 prompt tokens


@pytest.fixture(scope="module")
def short_context_model_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-ctx64")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, path / item.name)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (path / "config.json").write_text(json.dumps(config))
    return path


def job(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, id_column="id", chat=False, max_new_tokens=8, rows_per_part=2,
                           **overrides)


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), path)
    return path


def test_truncated_prompts_are_marked(src, tmp_path, short_context_model_dir):
    out = tmp_path / "out"
    summary = run_job(job(src, out, short_context_model_dir))
    rows = committed_rows(out)
    assert [rows[i]["prompt_truncated"] for i in range(len(TEXTS))] == [False, True, True, None, False]
    assert rows[3]["finish_reason"] == "error"  # a null prompt: no prompt, so neither true nor false
    assert summary.num_rows_truncated == 2
    assert pq.read_schema(next(out.glob("*.parquet"))).field("prompt_truncated").type == pa.bool_()


def test_a_directory_begun_before_the_column_keeps_its_schema(src, tmp_path, short_context_model_dir,
                                                              monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as m:  # what a batchgen from before the column wrote
        m.setattr(OutputSession, "writes_prompt_truncated", lambda self: False)
        run_job(job(src, out, short_context_model_dir, max_rows=2))
    run_job(job(src, out, short_context_model_dir))  # the resume, by this batchgen
    table = ds.dataset(str(out), format="parquet").to_table()
    assert table.num_rows == len(TEXTS) and "prompt_truncated" not in table.column_names
    compact_output(out)
    assert ds.dataset(str(out), format="parquet").to_table().sort_by("id").equals(table.sort_by("id"))
