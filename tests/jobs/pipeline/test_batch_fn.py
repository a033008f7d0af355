"""BatchGenerator, the engine-side batch function, without Ray: a table of input rows in, the rows
`batchgen run` writes for them out (same text, tokens and prompt hash), one per input row in input
order; a bad row is an error row, never an exception."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.store.schema import output_schema
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.pipeline.batch_columns import COMMITTED_HASH, INVALID, ROW_ID, SOURCE_PATH, SOURCE_ROW
from batchgen.jobs.pipeline.batch_fn import BatchGenerator
from tests.jobs.helpers import committed_rows, tiny_job_config

PROMPTS = ["a", "Hello world", "The quick brown fox jumps over the lazy dog", "x" * 70, "naïve café ☕",
           "Once upon a time, " * 5, "zz", "1234567890"]
COMPARED = ("generated_text", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error", "prompt_hash",
            "prompt_truncated")


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(chat=False, max_new_tokens=10, id_column="doc"),
                                                   **overrides})


@pytest.fixture()
def src(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"doc": [f"d{i}" for i in range(len(PROMPTS))], "text": PROMPTS,
                             "topic": list(range(len(PROMPTS)))}), path)
    return path


def test_output_equals_the_local_run_row_for_row(tmp_path, src, tiny_model_dir, loaded, one_thread):
    cfg = config(src, tmp_path / "out", tiny_model_dir)
    run_job(cfg, loaded=loaded)
    local = committed_rows(tmp_path / "out", "doc")
    out = BatchGenerator(cfg, loaded=loaded)(pq.read_table(src))
    assert out.column("doc").to_pylist() == [f"d{i}" for i in range(len(PROMPTS))]  # input order
    assert out.schema.names == ["doc", *COMPARED, "text", "topic"]  # every input column passes through
    for row in out.to_pylist():
        assert row == local[row["doc"]]
    assert sum(r["finish_reason"] != "error" for r in out.to_pylist()) == len(PROMPTS)


def test_bad_rows_become_error_rows(tmp_path, tiny_model_dir, loaded, one_thread):
    cfg = config(tmp_path / "unused.parquet", tmp_path / "out", tiny_model_dir, max_new_tokens_column="budget",
                 keep_columns=["budget"])
    table = pa.table({"doc": ["ok", "null", "empty", "budget", "invalid"],
                      "text": ["fine text", None, "", "fine", "fine too"],
                      "budget": [4, None, None, -3, None],
                      INVALID: [None, None, None, None, "column 'text' is not valid UTF-8"]})
    out = BatchGenerator(cfg, loaded=loaded)(table).to_pylist()
    assert [r["doc"] for r in out] == ["ok", "null", "empty", "budget", "invalid"]
    assert out[0]["finish_reason"] != "error" and out[0]["num_generated_tokens"] <= 4
    for row in out[1:]:
        assert row["finish_reason"] == "error" and row["generated_text"] is None and row["error"]
        assert row["num_generated_tokens"] == 0 and row["prompt_hash"] is None
    assert "budget" in out[3]["error"] and "UTF-8" in out[4]["error"]
    assert [r["budget"] for r in out] == [4, None, None, -3, None]  # --keep-columns passes through


def test_settled_rows_are_left_out_and_provenance_passes_through(tmp_path, src, tiny_model_dir, loaded, one_thread):
    cfg = config(src, tmp_path / "out", tiny_model_dir)
    generate = BatchGenerator(cfg, loaded=loaded)
    table = pq.read_table(src).slice(0, 3)
    first = generate(table).to_pylist()
    hashes = [first[0]["prompt_hash"], "0123456789abcdef", None]  # unchanged, changed, never committed
    table = (table.append_column(COMMITTED_HASH, pa.array(hashes, pa.string()))
             .append_column(SOURCE_PATH, pa.array(["f.parquet"] * 3))
             .append_column(SOURCE_ROW, pa.array([10, 11, 12], pa.int64())))
    out = generate(table)
    assert out.column("doc").to_pylist() == ["d1", "d2"]
    assert generate.num_rows_skipped == 1
    assert out.column(SOURCE_PATH).to_pylist() == ["f.parquet"] * 2
    assert out.column(SOURCE_ROW).to_pylist() == [11, 12]
    assert out.select(["doc", *COMPARED]).to_pylist() == [{k: r[k] for k in ("doc", *COMPARED)} for r in first[1:]]


def test_ids_without_an_id_column(tmp_path, tiny_model_dir, loaded, one_thread):
    cfg = tiny_job_config(tmp_path / "unused.parquet", tmp_path / "out", tiny_model_dir, chat=False, max_new_tokens=3)
    generate = BatchGenerator(cfg, loaded=loaded)
    out = generate(pa.table({"text": ["one", "two"]}))
    assert out.column("row_id").to_pylist() == ["0", "1"]
    given = generate(pa.table({"text": ["one", "two"], ROW_ID: ["in.parquet:7", "in.parquet:8"]}))
    assert given.column("row_id").to_pylist() == ["in.parquet:7", "in.parquet:8"]
    assert given.column("generated_text").to_pylist() == out.column("generated_text").to_pylist()  # seeds: greedy


def test_the_executors_schema_is_kept(tmp_path, src, tiny_model_dir, loaded, one_thread):
    cfg = config(src, tmp_path / "out", tiny_model_dir)
    schema = output_schema(pa.field("doc", pa.string()), [pa.field("topic", pa.int64())], with_prompt_hash=False)
    out = BatchGenerator(cfg, loaded=loaded, schema=schema)(pq.read_table(src).slice(0, 2))
    assert out.schema == schema


def test_constrained_rows_carry_json_valid(tmp_path, tiny_model_dir, loaded, one_thread):
    """The Ray executor's actors write json_valid as `batchgen run` does: per-row constraints and the job's."""
    import json

    from batchgen.io.store.schema import JSON_VALID

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    cells = [json.dumps({"type": "json_schema", "schema": schema}), json.dumps({"type": "choices", "choices": ["a"]}),
             None, json.dumps({"type": "nope"})]
    table = pa.table({"doc": [f"d{i}" for i in range(4)], "text": ["one", "two", "three", "four"],
                      "constraint": cells})
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    cfg = config(src, tmp_path / "out", tiny_model_dir, max_new_tokens=24, constraint_column="constraint")
    run_job(cfg, loaded=loaded)
    local = committed_rows(tmp_path / "out", "doc")
    out = BatchGenerator(cfg, loaded=loaded)(table)
    assert JSON_VALID in out.schema.names and "constraint" in out.schema.names
    rows = {r["doc"]: r for r in out.to_pylist()}
    for doc in ("d0", "d1", "d2"):
        assert rows[doc] == local[doc]
    # the bad cell's error names where the row came from: the file locally, the table here
    assert "in.parquet row 3: column 'constraint'" in local["d3"]["error"]
    assert "<batch> row 3: column 'constraint'" in rows["d3"]["error"]
    assert rows["d0"][JSON_VALID] is True and rows["d1"]["generated_text"] == "a" and rows["d1"][JSON_VALID] is None
    assert rows["d3"]["finish_reason"] == "error" and rows["d3"][JSON_VALID] is None
    job_schema = BatchGenerator(config(src, tmp_path / "out2", tiny_model_dir, max_new_tokens=24,
                                       json_schema=json.dumps(schema)), loaded=loaded)(table.drop(["constraint"]))
    assert job_schema.column(JSON_VALID).to_pylist() == [True] * 4
