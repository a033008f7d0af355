"""The progress line: tokens/s and the ETA count work (tokens), not finished rows."""

from __future__ import annotations

import io
import logging
import sys
import time

from batchgen.jobs.pipeline import progress as progress_module
from batchgen.jobs.pipeline.progress import Progress


def test_eta_counts_work_not_finished_rows():
    """Longest first: 1 of 10 rows has finished, but 300 of the 400 predicted tokens are generated."""
    progress = Progress(10, quiet=True, log_every_s=30, work=lambda: (300, 400))
    progress.started -= 30
    progress.update(num_generated_tokens=100)
    line = progress.line()
    progress.close()
    assert line.startswith("rows 1/10 (0 errors), 300 tokens, 10.0 tok/s"), line
    assert line.endswith("ETA 10s"), line  # 30 s for 300 tokens, 100 to go; rows would say 270 s


def test_rows_stand_in_without_a_prediction():
    progress = Progress(4, quiet=True, log_every_s=30)
    progress.started -= 10
    progress.update(num_generated_tokens=5)
    assert progress.line().endswith("5 tokens, 0.5 tok/s, ETA 30s")
    progress.close()
    unknown = Progress(4, quiet=True, log_every_s=30, work=lambda: (0, None))
    assert "ETA" not in unknown.line()
    unknown.close()


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_log_line_ticks_on_a_timer_before_any_row_finishes(caplog):
    """--quiet / no terminal: the line comes every log_every_s from the start, tokens in flight
    counted, not when a row happens to finish."""
    caplog.set_level(logging.INFO, logger="batchgen")
    progress = Progress(10, quiet=True, log_every_s=0.05, work=lambda: (120, 400))
    try:
        wait_for(lambda: any(r.getMessage().startswith("rows 0/10") for r in caplog.records))
    finally:
        progress.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("rows 0/10"))
    assert "120 tokens" in line and "ETA" in line, line


def test_bar_counts_tokens_and_shows_the_same_eta_as_the_log_line(monkeypatch):
    monkeypatch.setattr(progress_module, "terminal_columns", lambda stream: 80)
    terminal = FakeTerminal()
    progress = Progress(10, quiet=False, log_every_s=30, work=lambda: (300, 400), stream=terminal)
    progress.started -= 30
    progress._show()
    progress.close()
    shown = terminal.getvalue()
    assert "75%" in shown and "ETA 10s" in shown, shown  # tokens, not rows (0 of 10 finished: no row ETA)
    assert "rows 0/10" in shown


def test_log_lines_go_through_the_bar(monkeypatch):
    monkeypatch.setattr(progress_module, "terminal_columns", lambda stream: 80)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        progress = Progress(10, quiet=False, log_every_s=30, work=lambda: (300, 400), stream=terminal)
        progress._show()
        logging.getLogger("batchgen").warning("a warning while the bar is up")
        progress.close()
    finally:
        root.removeHandler(handler)
    shown = terminal.getvalue()
    before = shown[:shown.index("a warning while the bar is up")]
    # the bar's line was cleared (carriage return) before the record was written: not appended to it
    assert before.rstrip(" ").endswith("\r"), repr(before[-80:])


def test_a_terminal_of_width_zero_gets_log_lines(monkeypatch, caplog):
    monkeypatch.setattr(progress_module, "terminal_columns", lambda stream: 0)
    caplog.set_level(logging.INFO, logger="batchgen")
    progress = Progress(3, quiet=False, log_every_s=0.05, work=lambda: (5, 10), stream=FakeTerminal())
    assert progress._bar is None
    try:
        wait_for(lambda: any(r.getMessage().startswith("rows 0/3") for r in caplog.records))
    finally:
        progress.close()


def test_eta_counts_the_rate_since_the_first_token_not_the_prefill_before_it():
    """60 s of prefill, then 100 tokens in 10 s: 300 to go is 30 s, not 60 x 3 = 180 s."""
    tokens = [100]
    progress = Progress(4, quiet=True, log_every_s=30, work=lambda: (tokens[0], 400))
    progress.started -= 70
    first = progress.line()  # the first tokens seen: the reference point
    progress._first_tokens = (progress._first_tokens[0] - 10, 0)  # as if the first token came 10 s ago
    second = progress.line()
    progress.close()
    assert first.endswith("ETA 210s"), first  # elapsed-based until there is a rate since the first token
    assert second.endswith("ETA 30s"), second
