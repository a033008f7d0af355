"""The Ray executor beyond one local directory, on a real local Ray (2 CPUs): OpenAI Batch request files
in (and the Batch API files out), an s3:// output (moto's S3 server on localhost), and one shard of a
sharded job. Each equals the local executor's output row for row, exactly once."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchgen.ray
from batchgen.io.manifest.manifest import SUCCESS_FILE
from batchgen.io.store import lease as lease_module
from batchgen.io.store.factory import open_store
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.jobs.openai.test_openai_batch_job import REQUESTS, parquet_rows, read_lines, write_requests
from tests.jobs.openai.test_sharded_openai_batch import without_created
from tests.s3_server import committed_table

MAX_NEW = 6
NUM_ROWS = 24


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch):
    monkeypatch.setattr(lease_module, "LEASE_SETTLE_S", 0.05)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-out-in") / "in.parquet"
    pq.write_table(pa.table({"id": list(range(NUM_ROWS)), "text": [f"row {i} says {'ab' * (i % 7)}"
                                                                     for i in range(NUM_ROWS)]}),
                   path, row_group_size=6)  # row groups: a sharded job splits the file by them
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(max_new_tokens=MAX_NEW, commit_every_rows=4, metrics=False),
                                                    **overrides})


@pytest.fixture(scope="module")
def local_rows(src, tiny_model_dir, loaded, tmp_path_factory):
    """The job (derived ids) run by the local executor in one process: what every Ray run must equal."""
    out = tmp_path_factory.mktemp("ray-out-ref") / "out"
    run_job(config(src, out, tiny_model_dir), loaded=loaded)
    return committed_rows(out, "row_id")


def test_openai_batch_requests_and_files(ray_cluster, tiny_model_dir, loaded, tmp_path):
    src = write_requests(tmp_path / "requests.jsonl", REQUESTS)
    batch = dict(input_format="openai-batch", output_format="openai-batch")
    run_job(config(src, tmp_path / "local", tiny_model_dir, **batch), loaded=loaded)
    summary = batchgen.ray.run(config(src, tmp_path / "ray", tiny_model_dir, **batch), num_actors=2)
    assert summary.complete and summary.executor == "ray" and summary.num_rows == len(REQUESTS)
    assert parquet_rows(tmp_path / "ray") == parquet_rows(tmp_path / "local")
    local_files, ray_files = read_lines(tmp_path / "local"), read_lines(tmp_path / "ray")  # validated, once each
    for local, ray in zip(local_files, ray_files, strict=True):
        assert {k: without_created(v) for k, v in ray.items()} == {k: without_created(v) for k, v in local.items()}


@pytest.mark.soak
def test_s3_output_then_a_resume(ray_cluster, src, tiny_model_dir, loaded, local_rows, s3_out):
    run_job(config(src, s3_out, tiny_model_dir, max_rows=10), loaded=loaded)  # a first run got this far
    summary = batchgen.ray.run(config(src, s3_out, tiny_model_dir), num_actors=2)
    assert (summary.num_rows, summary.num_rows_skipped) == (NUM_ROWS - 10, 10) and summary.complete
    store = open_store(s3_out)
    assert store.exists(SUCCESS_FILE) and json.loads(store.read_bytes("_summary.json"))["executor"] == "ray"
    table = committed_table(s3_out)
    ids = table.column("row_id").to_pylist()
    assert len(ids) == len(set(ids)) == NUM_ROWS
    assert {r["row_id"]: r for r in table.to_pylist()} == local_rows


def test_shards_on_ray_then_finalize_equal_one_process(ray_cluster, src, tiny_model_dir, loaded, local_rows,
                                                        tmp_path):
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)  # one shard locally
    summary = batchgen.ray.run(config(src, out, tiny_model_dir, num_shards=2, shard_index=1), num_actors=2)
    assert summary.complete and 0 < summary.num_rows < NUM_ROWS
    shards = [committed_rows(out / f"shard-{i}-of-2", "row_id") for i in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert finalize_output(out)["rows"] == NUM_ROWS
    assert {**shards[0], **shards[1]} == local_rows  # derived ids count from the file's start in each shard


def test_constrained_rows_and_json_valid(ray_cluster, tiny_model_dir, loaded, tmp_path):
    """Per-row constraints (a bad cell an error row) on Ray: the json_valid column and every row as the
    local executor writes them."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    cells = [json.dumps({"type": "json_schema", "schema": schema}),
             json.dumps({"type": "regex", "pattern": "[a-c]{3}"}), None, "not json"] * 3
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(cells))), "text": [f"row {i}" for i in range(len(cells))],
                             "constraint": cells}), src)
    settings = dict(id_column="id", constraint_column="constraint", max_new_tokens=24)
    run_job(config(src, tmp_path / "local", tiny_model_dir, **settings), loaded=loaded)
    summary = batchgen.ray.run(config(src, tmp_path / "ray", tiny_model_dir, **settings), num_actors=2)
    assert summary.complete and summary.num_rows_error == 3
    local, on_ray = committed_rows(tmp_path / "local", "id"), committed_rows(tmp_path / "ray", "id")
    assert on_ray == local
    assert [on_ray[i]["json_valid"] for i in range(4)] == [True, None, None, None]
