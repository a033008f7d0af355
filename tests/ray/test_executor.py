"""The Ray executor on a real local Ray (2 CPUs, 2 actors), tiny model, greedy float32: the same
committed rows as the local executor, row for row; a resume skips committed rows (by derived id,
and by prompt hash under --id-column); the CLI flag and its summary; engines kept warm serve the
next job and then end themselves."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import batchgen.ray
from batchgen.cli import app
from batchgen.jobs.run import run_job
from batchgen.ray.engines import NAMESPACE
from tests.jobs.helpers import committed_rows, tiny_job_config

MAX_NEW = 8


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Two files: Parquet and JSON Lines, a passthrough column only one has, an empty prompt (error row)."""
    d = tmp_path_factory.mktemp("ray-in")
    texts = [f"row {i}: " + "abc def ghi "[: 1 + i % 12] * (1 + i % 5) for i in range(30)]
    texts[7] = ""
    pq.write_table(pa.table({"text": texts, "topic": [i % 3 for i in range(30)]}), d / "a.parquet",
                   row_group_size=8)
    with open(d / "b.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"text": f"jsonl line {i} " * (1 + i % 4)}) + "\n")
    return [d / "a.parquet", d / "b.jsonl"]


def config(inputs, out, model_dir, **overrides):
    return tiny_job_config(inputs, out, model_dir, **{**dict(chat=False, max_new_tokens=MAX_NEW, commit_every_rows=8,
                                                             metrics=False), **overrides})


@pytest.fixture(scope="module")
def local_rows(inputs, tiny_model_dir, loaded, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    run_job(config(inputs, out, tiny_model_dir), loaded=loaded)
    return committed_rows(out, "row_id")


def test_same_rows_as_the_local_executor(ray_cluster, inputs, tiny_model_dir, local_rows, tmp_path):
    out = tmp_path / "out"
    summary = batchgen.ray.run(config(inputs, out, tiny_model_dir), num_actors=2)
    assert (summary.executor, summary.num_actors, summary.num_rows, summary.num_rows_error) == ("ray", 2, 40, 1)
    assert summary.complete and (out / "_SUCCESS").is_file()
    assert summary.num_commits >= 5  # every 8 rows, on the driver
    assert committed_rows(out, "row_id") == local_rows  # every column, every row
    assert local_rows["a.parquet:7"]["finish_reason"] == "error"
    assert local_rows["b.jsonl:3"]["topic"] is None  # unified passthrough: null where a file lacks it


def test_resume_skips_committed_rows(ray_cluster, inputs, tiny_model_dir, local_rows, loaded, tmp_path):
    out = tmp_path / "out"
    run_job(config(inputs, out, tiny_model_dir, max_rows=15), loaded=loaded)  # a first run got this far
    summary = batchgen.ray.run(config(inputs, out, tiny_model_dir), num_actors=2)
    # the first run's error row (a.parquet:7) is retried, as the local executor retries it
    assert (summary.num_rows, summary.num_rows_skipped, summary.num_rows_retried) == (26, 14, 1)
    assert committed_rows(out, "row_id") == local_rows
    result = CliRunner().invoke(app, ["run", "--input", str(inputs[0]), "--input", str(inputs[1]), "--output",
                                      str(out), "--model", str(tiny_model_dir), "--device", "cpu", "--dtype",
                                      "float32", "--no-chat", "--max-new-tokens", str(MAX_NEW), "--quiet",
                                      "--executor", "ray", "--ray-actors", "1", "--no-retry-errors"])
    assert result.exit_code == 0, result.output
    assert "nothing to do: all 40 rows are committed" in result.output


def test_id_column_resume_regenerates_only_changed_prompts(ray_cluster, tiny_model_dir, tmp_path):
    src = tmp_path / "in.parquet"
    texts = [f"prompt number {i}" for i in range(12)]
    pq.write_table(pa.table({"doc": list(range(12)), "text": texts}), src)
    out = tmp_path / "out"
    first = batchgen.ray.run(config(src, out, tiny_model_dir, id_column="doc"), num_actors=2)
    assert first.num_rows == 12
    before = committed_rows(out, "doc")
    texts[5] = "a different prompt"
    pq.write_table(pa.table({"doc": list(range(12)), "text": texts}), src)
    again = batchgen.ray.run(config(src, out, tiny_model_dir, id_column="doc"), num_actors=2)
    assert (again.num_rows, again.num_rows_changed, again.num_rows_replaced, again.num_rows_skipped) == (1, 1, 1, 11)
    after = committed_rows(out, "doc")
    assert after[5]["prompt_hash"] != before[5]["prompt_hash"]
    assert {i: r for i, r in after.items() if i != 5} == {i: r for i, r in before.items() if i != 5}


def warm_engines(ray) -> dict[str, int]:
    """The kept-warm engines alive on the cluster: name -> process id."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    pids = {}
    for name in names:
        try:
            pids[name] = ray.get(ray.get_actor(name, namespace=NAMESPACE).ready.remote())
        except (ValueError, ray.exceptions.RayActorError):  # ended meanwhile
            pass
    return pids


# last in the module: until they end, the warm engines hold both CPUs
def test_kept_warm_engines_serve_the_next_job_then_end(ray_cluster, inputs, tiny_model_dir, local_rows, tmp_path):
    ray = ray_cluster
    keep = {"ray_keep_warm_s": 10.0}
    batchgen.ray.run(config(inputs, tmp_path / "first", tiny_model_dir, **keep), num_actors=2)
    engines = warm_engines(ray)
    assert len(engines) == 2
    summary = batchgen.ray.run(config(inputs, tmp_path / "second", tiny_model_dir, **keep), num_actors=2)
    assert warm_engines(ray) == engines  # the same processes: imports and model loads paid once
    assert summary.complete and committed_rows(tmp_path / "second", "row_id") == local_rows
    deadline = time.monotonic() + 120  # idle for 10 s, each ends itself (checked every 5 s)
    while warm_engines(ray) and time.monotonic() < deadline:
        time.sleep(1)
    assert not warm_engines(ray)
