"""The progress bar and line: rows of the run's rows, elapsed and remaining time (the ETA prices
prompt and output work: batchgen.monitor.eta), input and output tokens/s."""

from __future__ import annotations

import io
import logging
import sys
import time

from batchgen.engine.metrics import StepStats
from batchgen.jobs.pipeline import progress as progress_module
from batchgen.jobs.pipeline.progress import Progress
from batchgen.monitor.eta import PredictedWork, WorkMeter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def prefill_meter(clock: Clock, *, seconds: float, prompt_tokens: int, output_tokens: int = 0,
                  predicted: PredictedWork | None = PredictedWork(3000, 10)) -> WorkMeter:
    """A meter that has seen `seconds` of one-second steps of the given tokens each."""
    meter = WorkMeter(lambda: predicted, clock=clock)
    for _ in range(int(seconds)):
        clock.t += 1.0
        meter.on_step(StepStats(step_seconds=1.0, num_running=1, num_waiting=0,
                                num_batched_tokens=prompt_tokens + output_tokens, num_sampled_tokens=output_tokens,
                                num_kv_blocks_used=1, num_kv_blocks_free=1, num_preempted=0,
                                num_prompt_tokens=prompt_tokens))
    return meter


def test_line_shows_rows_elapsed_eta_and_input_and_output_rates_during_prefill():
    """30 s of prefill at 50 prompt tokens/s, no row finished, no token generated: the line says
    so, and prices the 1500 prompt and 10 output tokens left at 20 ms each (30.2 s)."""
    clock = Clock()
    progress = Progress(10, quiet=True, log_every_s=3600, clock=clock)
    progress.meter = prefill_meter(clock, seconds=30, prompt_tokens=50)
    line = progress.line()
    progress.close()
    assert line == ("rows 0/10 (0%), elapsed 30.0s, ETA 30.2s, input 50.0 tok/s, output 0.0 tok/s, 0 errors; "
                    "1500 prompt and 0 generated tokens"), line


def test_rows_stand_in_without_a_meter():
    clock = Clock()
    progress = Progress(4, quiet=True, log_every_s=3600, clock=clock)
    clock.t += 10
    progress.update(num_generated_tokens=5)
    line = progress.line()
    progress.close()
    assert line.startswith("rows 1/4 (25%), elapsed 10.0s, ETA 30.0s, input ? tok/s, output 0.5 tok/s"), line
    unknown = Progress(None, quiet=True, log_every_s=3600, meter=WorkMeter(lambda: None))
    assert "ETA ?" in unknown.line() and unknown.line().startswith("rows 0, ")
    unknown.close()


def test_the_last_line_reads_every_row_and_no_time_left():
    """The prediction was short (the rows generated more than it said): all rows done is ETA 0."""
    clock = Clock()
    progress = Progress(2, quiet=True, log_every_s=3600, clock=clock)
    progress.meter = prefill_meter(clock, seconds=4, prompt_tokens=10, output_tokens=5,
                                   predicted=PredictedWork(1000, 1000))
    progress.update(num_generated_tokens=10)
    progress.update(num_generated_tokens=10, error=True)
    line = progress.line()
    progress.close()
    assert line.startswith("rows 2/2 (100%), elapsed 4.0s, ETA 0.0s, input 10.0 tok/s, output 5.0 tok/s, 1 errors")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_log_line_ticks_on_a_timer_before_any_row_finishes(caplog):
    """--quiet / no terminal: the line comes every log_every_s from the start, prompt tokens
    counted, not when a row happens to finish."""
    caplog.set_level(logging.INFO, logger="batchgen")
    meter = prefill_meter(Clock(), seconds=3, prompt_tokens=40)
    progress = Progress(10, quiet=True, log_every_s=0.05, meter=meter)
    try:
        wait_for(lambda: any(r.getMessage().startswith("rows 0/10") for r in caplog.records))
    finally:
        progress.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("rows 0/10"))
    assert "120 prompt and 0 generated tokens" in line and "ETA ?" not in line, line


def test_bar_fills_over_rows_with_time_left_and_token_rates(monkeypatch):
    """The bar: rows done of the run's rows and their %, elapsed<remaining from the meter (not
    tqdm's rows-per-second guess), input and output tok/s; 100% and <00:00 once every row is done."""
    monkeypatch.setattr(progress_module, "terminal_columns", lambda stream: 120)
    terminal = FakeTerminal()
    clock = Clock()
    progress = Progress(4, quiet=False, log_every_s=3600, stream=terminal, clock=clock)
    progress.meter = prefill_meter(clock, seconds=30, prompt_tokens=50)  # 30.2 s left, as above
    progress._show()
    during = terminal.getvalue().split("\r")[-1]
    for _ in range(4):
        progress.update(num_generated_tokens=3)
    progress.close()
    final = terminal.getvalue().split("\r")[-1]
    assert during.startswith("rows:   0%|"), during
    assert "| 0/4 [00:00<00:30, input 50.0 tok/s, output 0.0 tok/s, 0 errors]" in during, during
    assert final.startswith("rows: 100%|") and "| 4/4 [" in final and "<00:00, input 50.0 tok/s" in final, final
    assert not any(stray in terminal.getvalue() for stray in (", ,", "[, ", ", ]")), terminal.getvalue()


def test_log_lines_go_through_the_bar(monkeypatch):
    monkeypatch.setattr(progress_module, "terminal_columns", lambda stream: 80)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        progress = Progress(10, quiet=False, log_every_s=30, stream=terminal)
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
    progress = Progress(3, quiet=False, log_every_s=0.05, stream=FakeTerminal())
    assert progress._bar is None
    try:
        wait_for(lambda: any(r.getMessage().startswith("rows 0/3") for r in caplog.records))
    finally:
        progress.close()
