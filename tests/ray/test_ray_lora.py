"""A --lora job on the Ray executor (2 actors, each loading the adapters once): every row once, on
its own adapter, with the local executor's text and prompt hash."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

import batchgen.ray
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.lora_adapters import make_adapters
from tests.tiny import make_tiny_model

ADAPTERS = ["attn4", None, "all16", "mlp8", "", "attn4", "all16"]


def test_lora_rows_on_ray_equal_the_local_executor(ray_cluster, tiny_model_dir, loaded, tmp_path):
    dirs = make_adapters(make_tiny_model("llama"), tmp_path / "lora")  # tiny_model_dir's weights
    adapters = [ADAPTERS[i % len(ADAPTERS)] for i in range(21)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(21)), "text": [f"row {i}: " + "abc " * (1 + i % 5) for i in range(21)],
                             "adapter": adapters}), src)

    def config(out):
        return tiny_job_config(src, out, tiny_model_dir, id_column="id", chat=False, max_new_tokens=6,
                               ignore_eos=True, metrics=False, commit_every_rows=5, lora=dirs,
                               lora_column="adapter")

    run_job(config(tmp_path / "local"), loaded=loaded)
    summary = batchgen.ray.run(config(tmp_path / "ray"), num_actors=2)
    assert summary.complete and (summary.num_rows, summary.num_rows_error) == (21, 0)
    local, ray_rows = committed_rows(tmp_path / "local"), committed_rows(tmp_path / "ray")
    assert sorted(ray_rows) == list(range(21))
    for i, adapter in enumerate(adapters):
        assert ray_rows[i]["adapter"] == (adapter or None), i
        for column in ("generated_text", "prompt_hash"):
            assert ray_rows[i][column] == local[i][column], (i, adapter, column)
