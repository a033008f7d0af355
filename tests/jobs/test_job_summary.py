"""JobSummary.count_row: the per-row counts both executors keep (batchgen.jobs.executors.local, batchgen.ray.driver)."""

from __future__ import annotations

from batchgen.jobs.pipeline.summary import RunSummary


def test_count_row_counts_ok_and_error_rows_and_their_tokens():
    s = RunSummary(output_dir="out", model="m", mode="auto")
    assert s.count_row({"finish_reason": "length", "num_prompt_tokens": 5, "num_generated_tokens": 3}) is False
    assert s.count_row({"finish_reason": "error", "num_prompt_tokens": None, "num_generated_tokens": None}) is True
    assert (s.num_rows, s.num_rows_ok, s.num_rows_error) == (2, 1, 1)
    assert (s.num_prompt_tokens, s.num_generated_tokens) == (5, 3)
