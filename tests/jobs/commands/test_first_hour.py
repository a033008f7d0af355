"""A job's own size decides its KV cache; sampling controls reach every row; plural summaries."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchgen.config.job import build_config
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.pipeline.summary import RunSummary

MAX_NEW = 6


def job(src, out, model_dir, **overrides):
    values = dict(inputs=[str(src)], output=str(out), model=str(model_dir), device="cpu", dtype="float32",
                  chat=False, max_new_tokens=MAX_NEW, kv_cache_memory="16MiB", quiet=True)
    values.update(overrides)
    return build_config(None, **values)


def rows(out) -> dict:
    return {r["row_id"]: r for r in ds.dataset(str(out), format="parquet").to_table().to_pylist()}


def test_a_small_job_sizes_its_kv_cache_from_its_rows(tmp_path, eos_model_dir, loaded_eos):
    """5 short rows need a few blocks, not the whole budget (2 GiB by default on CPU; 16 MiB here)."""
    texts = ["a", "bb", "ccc", "dddd", "eeeee"]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts}), src)
    summary = run_job(job(src, tmp_path / "out", eos_model_dir), loaded=loaded_eos)
    block_size = 16
    # byte-level tokenizer, one BOS: each row needs len(text) + 1 prompt tokens + MAX_NEW, in whole blocks
    needed = sum(-(-(len(t) + 1 + MAX_NEW) // block_size) for t in texts)
    assert summary.engine["kv_blocks_total"] == needed == 5
    assert len(rows(tmp_path / "out")) == 5


def test_a_large_job_keeps_the_budget(tmp_path, eos_model_dir, loaded_eos):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(12)]}), src)
    summary = run_job(job(src, tmp_path / "out", eos_model_dir, window_rows=4), loaded=loaded_eos)
    assert summary.engine["kv_blocks_total"] > 12  # more rows than one window: sized by the budget


def test_sampling_column_sets_min_tokens_per_row_and_bad_cells_are_error_rows(tmp_path, eos_model_dir, loaded_eos):
    """The EOS-happy tiny model stops at once on most rows; min_tokens holds EOS back for the rows
    that ask, and a cell naming an unknown setting becomes that row's error."""
    texts = [f"row {i}" for i in range(6)]
    cells = [None, json.dumps({"min_tokens": 5}), None, json.dumps({"min_tokens": 5, "repetition_penalty": 1.3}),
             json.dumps({"max_tokens": 3}), "{}"]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts, "params": cells}), src)
    out = tmp_path / "out"
    run_job(job(src, out, eos_model_dir, sampling_column="params", keep_columns=[], chat=True), loaded=loaded_eos)
    got = rows(out)
    plain = [got[f"in.parquet:{i}"]["num_generated_tokens"] for i in (0, 2, 5)]
    assert min(plain) < 5, "the model must stop early somewhere for the test to mean anything"
    for i in (1, 3):
        assert got[f"in.parquet:{i}"]["num_generated_tokens"] >= 5
    bad = got["in.parquet:4"]
    assert bad["finish_reason"] == "error" and "unknown sampling setting 'max_tokens'" in bad["error"]


def test_job_level_min_tokens_holds_back_eos(tmp_path, eos_model_dir, loaded_eos):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(4)]}), src)
    run_job(job(src, tmp_path / "out", eos_model_dir, chat=True), loaded=loaded_eos)
    assert min(r["num_generated_tokens"] for r in rows(tmp_path / "out").values()) < 4
    run_job(job(src, tmp_path / "held", eos_model_dir, chat=True, min_tokens=4), loaded=loaded_eos)
    assert all(r["num_generated_tokens"] >= 4 for r in rows(tmp_path / "held").values())


def test_summary_lines_count_in_the_singular():
    summary = RunSummary(output_dir="out", model="m", mode="auto", num_rows=1, num_rows_ok=1, num_commits=1,
                         num_windows_continuous=1, num_length_predictions=1, output_rows=1, complete=True)
    text = "\n".join(summary.lines())
    assert "done: 1 row (1 ok, 0 errors, 0 truncated prompts)" in text
    assert "1 commit;" in text and "1 continuous window," in text and "0 static fallbacks" in text
    assert "1 commits" not in text and "1 rows" not in text and "1 windows" not in text
