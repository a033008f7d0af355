"""`batchgen plan` says what the output will weigh, and how much of it is copied input."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config.job import build_config
from batchgen.jobs.commands.plan import plan_job, plan_lines
from batchgen.jobs.planning.output_size import OutputSize, cell_bytes

TEXTS = ["a document of some length " * 8, "another one, naïve café", "short"]


def plan(src, model_dir, loaded, **overrides):
    config = build_config(None, inputs=[str(src)], model=str(model_dir), device="cpu", dtype="float32", chat=False,
                          max_new_tokens=8, kv_cache_memory="16MiB", need_output=False, **overrides)
    return plan_job(config, loaded=loaded, calibration_rows=2)


def test_plan_reports_copied_columns_and_generated_text(tmp_path, tiny_model_dir, loaded):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": TEXTS, "n": [1, 2, 3]}), src)
    report = plan(src, tiny_model_dir, loaded)
    size = report["output_size"]
    assert size["copied_columns"] == {"text": sum(len(t.encode()) for t in TEXTS), "n": 3 * 8}
    # byte-level tokenizer: a token is a byte of text, so 8 tokens of 3 rows are ~24 bytes
    assert size["bytes_per_token"] <= 1.0 and 0 < size["generated_text_bytes"] <= 3 * 8
    line = next(line for line in plan_lines(report) if line.startswith("output size:"))
    assert "copied input columns" in line and "text " in line and "--keep-columns" in line

    lean = plan(src, tiny_model_dir, loaded, keep_columns=["n"])["output_size"]
    assert lean["copied_columns"] == {"n": 24} and lean["total_bytes"] < size["total_bytes"]


def test_cell_sizes():
    assert cell_bytes("é") == 2 and cell_bytes(None) == 0 and cell_bytes(7) == 8 and cell_bytes(["ab", "c"]) == 3
    size = OutputSize(["a"])
    size.add("id-1", {"a": "xyz"})
    assert size.describe(10, 4.0)["total_bytes"] == 40 + 3 + 4 + 16


def test_a_job_with_n_samples_plans_every_samples_row(tmp_path, tiny_model_dir, loaded):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": TEXTS}), src)
    one, three = plan(src, tiny_model_dir, loaded), plan(src, tiny_model_dir, loaded, n=3)
    assert three["predicted_output_tokens"] == 3 * one["predicted_output_tokens"]
    assert three["windows"][0]["num_sequences"] == 9 and one["windows"][0]["num_sequences"] == 3
    assert three["output_size"]["copied_columns"] == {"text": 3 * sum(len(t.encode()) for t in TEXTS)}
    assert three["output_size"]["generated_text_bytes"] >= 3 * one["output_size"]["generated_text_bytes"] - 3
