"""JobSummary.count_row: the per-row counts both executors keep (executors/local.py, executors/ray/driver.py)."""

from __future__ import annotations

from batchgen.jobs.pipeline.summary import RunSummary


def test_count_row_counts_ok_and_error_rows_and_their_tokens():
    s = RunSummary(output_dir="out", model="m", mode="auto")
    assert s.count_row({"finish_reason": "length", "num_prompt_tokens": 5, "num_generated_tokens": 3}) is False
    assert s.count_row({"finish_reason": "error", "num_prompt_tokens": None, "num_generated_tokens": None}) is True
    assert (s.num_rows, s.num_rows_ok, s.num_rows_error) == (2, 1, 1)
    assert (s.num_prompt_tokens, s.num_generated_tokens) == (5, 3)


def test_the_resume_line_says_which_rows_were_continued_from_checkpoints_and_their_tokens():
    """A resume after a stop continues rows from their in-flight checkpoints: the summary says how
    many and how many tokens were kept, not only that no row was committed before."""
    s = RunSummary(output_dir="out", model="m", mode="auto", num_rows=3, num_rows_ok=3,
                   num_rows_continued=3, num_tokens_continued=41, output_rows=3, complete=True)
    resume = next(line for line in s.lines() if line.startswith("resume:"))
    assert resume.startswith("resume: 0 rows already committed, 3 rows continued from in-flight checkpoints "
                             "(41 tokens they held, not generated again), 0 error rows retried"), resume
