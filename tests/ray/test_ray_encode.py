"""--task embed on the Ray executor: the same committed rows as the local executor writes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import batchgen.ray
from batchgen.jobs.commands.run import run_job
from tests.jobs.encode_fixtures import save_tiny_encoder_dir
from tests.jobs.helpers import committed_rows, tiny_job_config


def test_embed_job_on_ray_equals_the_local_executor(ray_cluster, tmp_path):
    model_dir = save_tiny_encoder_dir(tmp_path / "tiny-st")
    texts = [f"row {i}: " + "abc def "[: 1 + i % 8] * (1 + i % 4) for i in range(12)]
    texts[5] = ""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(12)), "text": texts}), src)

    def config(out):
        return tiny_job_config(src, out, model_dir, task="embed", id_column="id", metrics=False, commit_every_rows=4)

    run_job(config(tmp_path / "local"))
    summary = batchgen.ray.run(config(tmp_path / "ray"), num_actors=1)
    assert summary.complete and (summary.num_rows, summary.num_rows_error) == (12, 1)
    local, ray_rows = committed_rows(tmp_path / "local"), committed_rows(tmp_path / "ray")
    assert sorted(ray_rows) == list(range(12)) and "is empty" in ray_rows[5]["error"]
    for i, row in local.items():
        assert ray_rows[i]["prompt_hash"] == row["prompt_hash"]
        if row["embedding"] is not None:
            assert np.allclose(ray_rows[i]["embedding"], row["embedding"], atol=1e-5)
