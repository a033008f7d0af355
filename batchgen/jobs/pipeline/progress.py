"""Progress of a job: a tqdm bar on a terminal, a log line every N seconds otherwise.

Both show what vLLM's `LLM.generate` shows, from the same figures: rows finished of the run's
rows (the bar fills over rows and reaches 100% when the last one finishes), the time elapsed and
the time remaining, and the prompt (input) and generated (output) tokens per second. The time
remaining is batchgen.monitor.eta's: the planner's predicted prompt and output tokens left, priced
at the measured cost of each, so it is sane from the first engine step, prefill included; without
a meter (or before a row is planned) finished rows stand in for work.

Both tick on a timer from the moment the job starts, not when a row finishes: rows run longest
predicted output first, so in a window's first minutes few rows finish while every slot works.

On a terminal, log lines are written through the bar (tqdm's logging redirect), so they never
print into it. A terminal of width 0 (some CI consoles) gets the log lines instead of a bar.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from batchgen.monitor.eta import WorkEstimate, WorkMeter

log = logging.getLogger("batchgen")

BAR_REFRESH_S = 1.0  # how often the bar is redrawn between finished rows
MIN_TICK_S = 0.05  # log_every_s=0 (tests) still leaves the job's thread most of the time
BAR_FORMAT = "rows: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{left}, {stats}]"
BAR_FORMAT_NO_TOTAL = "rows: {n_fmt} [{elapsed}<{left}, {stats}]"


def terminal_columns(stream: TextIO) -> int | None:
    """The terminal's width, 0 when it reports none; None when `stream` is not a terminal."""
    try:
        if not stream.isatty():
            return None
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def duration(seconds: float | None) -> str:
    """mm:ss or h:mm:ss, as tqdm writes elapsed time; '?' when unknown."""
    return "?" if seconds is None else tqdm.format_interval(max(0.0, seconds))


def token_rate(tokens_per_s: float | None) -> str:
    return "?" if tokens_per_s is None else f"{tokens_per_s:.1f}" if tokens_per_s < 100 else f"{tokens_per_s:.0f}"


class _RowsBar(tqdm):
    """tqdm's bar with our remaining time and token rates: tqdm's own remaining is finished rows
    over their rate, which reads hours while the first rows' prompts are prefilled."""

    def __init__(self, *args, stats: str, **kwargs):
        self.left = "?"
        self.stats = stats  # before tqdm's first draw, which its __init__ makes
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        return {**super().format_dict, "left": self.left, "stats": self.stats}


class Progress:
    def __init__(self, total_rows: int | None, *, quiet: bool, log_every_s: float, meter: WorkMeter | None = None,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total_rows = total_rows
        self.meter = meter
        self.clock = clock
        self.num_rows = 0
        self.num_errors = 0
        self.num_generated_tokens = 0  # finished rows': the output count without a meter
        self.started = clock()
        self.log_every_s = log_every_s
        stream = stream if stream is not None else sys.stderr
        self._bar: _RowsBar | None = None
        self._redirect = contextlib.ExitStack()
        if not quiet and terminal_columns(stream):
            self._bar = _RowsBar(total=total_rows, unit="row", dynamic_ncols=True, file=stream,
                                 bar_format=BAR_FORMAT if total_rows else BAR_FORMAT_NO_TOTAL,
                                 stats=self._stats(WorkEstimate(0, 0, None, None, None)))
            # log records go through tqdm.write: the bar is cleared, the line printed, the bar redrawn
            self._redirect.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger()]))
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="batchgen-progress", daemon=True)
        self._ticker.start()

    def update(self, *, num_generated_tokens: int = 0, error: bool = False) -> None:
        """A row finished (or failed); the ticker shows it at its next tick."""
        self.num_rows += 1
        self.num_errors += int(error)
        self.num_generated_tokens += num_generated_tokens

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.started

    @property
    def done(self) -> bool:
        return self.total_rows is not None and self.num_rows >= self.total_rows

    def estimate(self) -> WorkEstimate:
        """The meter's estimate; finished rows stand in for the ETA where it has none."""
        elapsed = self.elapsed_s
        if self.meter is not None:
            est = self.meter.estimate()
        else:
            rate = self.num_generated_tokens / elapsed if elapsed > 0 else None
            est = WorkEstimate(0, self.num_generated_tokens, None, rate, None)
        eta = est.eta_s
        if self.done:
            eta = 0.0
        elif eta is None and self.total_rows and self.num_rows:
            eta = elapsed * (self.total_rows - self.num_rows) / self.num_rows
        return WorkEstimate(est.num_prompt_tokens_done, est.num_output_tokens_done, est.input_tokens_per_s,
                            est.output_tokens_per_s, eta, est.fraction_done)

    def _stats(self, est: WorkEstimate) -> str:
        return (f"input {token_rate(est.input_tokens_per_s)} tok/s, output {token_rate(est.output_tokens_per_s)} "
                f"tok/s, {self.num_errors} errors")

    def line(self) -> str:
        """The --quiet (or no terminal) line: the bar's figures, and the tokens so far."""
        est = self.estimate()
        total = f"/{self.total_rows}" if self.total_rows is not None else ""
        percent = f" ({100 * self.num_rows / self.total_rows:.0f}%)" if self.total_rows else ""
        eta = "?" if est.eta_s is None else f"{est.eta_s:.1f}s"  # seconds: a log is read by scripts too
        return (f"rows {self.num_rows}{total}{percent}, elapsed {self.elapsed_s:.1f}s, ETA {eta}, "
                f"{self._stats(est)}; {est.num_prompt_tokens_done} prompt and "
                f"{est.num_output_tokens_done} generated tokens")

    def _tick(self) -> None:
        interval = BAR_REFRESH_S if self._bar is not None else max(self.log_every_s, MIN_TICK_S)
        while not self._stop.wait(interval):
            self._show()

    def _show(self) -> None:
        if self._bar is None:
            log.info("%s", self.line())
            return
        est = self.estimate()
        self._bar.n = self.num_rows
        self._bar.left = duration(est.eta_s)
        self._bar.stats = self._stats(est)
        self._bar.refresh()

    def close(self) -> None:
        self._stop.set()
        self._ticker.join()
        self._show()  # the last state: every row counted
        if self._bar is not None:
            self._bar.close()
        self._redirect.close()
