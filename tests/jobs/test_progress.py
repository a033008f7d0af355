"""The progress line: tokens/s and the ETA count work (tokens), not finished rows."""

from __future__ import annotations

from batchgen.jobs.progress import Progress


def test_eta_counts_work_not_finished_rows():
    """Longest first: 1 of 10 rows has finished, but 300 of the 400 predicted tokens are generated."""
    progress = Progress(10, quiet=True, log_every_s=30, work=lambda: (300, 400))
    progress.started -= 30
    progress.update(num_generated_tokens=100)
    line = progress.line()
    assert line.startswith("rows 1/10 (0 errors), 300 tokens, 10.0 tok/s"), line
    assert line.endswith("ETA 10s"), line  # 30 s for 300 tokens, 100 to go; rows would say 270 s


def test_rows_stand_in_without_a_prediction():
    progress = Progress(4, quiet=True, log_every_s=30)
    progress.started -= 10
    progress.update(num_generated_tokens=5)
    assert progress.line().endswith("5 tokens, 0.5 tok/s, ETA 30s")
    assert "ETA" not in Progress(4, quiet=True, log_every_s=30, work=lambda: (0, None)).line()
