"""A sharded --task score job: its shards + finalize equal the unsharded job, row for row."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.jobs.commands.run import run_job
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import committed_rows, tiny_job_config


def test_sharded_score_job_equals_the_unsharded_one(tmp_path, tiny_model_dir):
    src = tmp_path / "in.parquet"
    texts = [f"row {i}: " + "the cat sat " * (1 + i % 5) for i in range(14)]
    pq.write_table(pa.table({"id": list(range(14)), "text": texts}), src, row_group_size=4)

    def config(out, **shard):
        return tiny_job_config(src, out, tiny_model_dir, task="score", id_column="id", chat=False, **shard)

    run_job(config(tmp_path / "one"))
    for index in range(2):
        run_job(config(tmp_path / "sharded", num_shards=2, shard_index=index))
    result = finalize_output(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "_SUCCESS").is_file() and result["num_shards"] == 2
    one, sharded = committed_rows(tmp_path / "one"), committed_rows(tmp_path / "sharded")
    assert sorted(sharded) == sorted(one) == list(range(14))
    for i, row in one.items():
        assert sharded[i]["num_scored_tokens"] == row["num_scored_tokens"] > 0
        assert sharded[i]["logprob"] == pytest.approx(row["logprob"], rel=1e-5)
