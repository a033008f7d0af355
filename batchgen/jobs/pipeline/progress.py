"""Progress of a job: a tqdm bar on a terminal, a log line every N seconds otherwise.

Both tick on a timer from the moment the job starts generating, not when a row finishes: rows run
longest predicted output first, so in a shard's first minutes few rows finish while every slot
generates. They count work, not rows: with a `work` callable (tokens generated so far, in flight
included; the job's predicted total) the ETA is the tokens to go over the rate since the first
token was seen (the prompts' prefill before it would otherwise make the first minutes' ETA hours
long), the same figure in the bar and in the log line; without it, rows stand in for work.

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

log = logging.getLogger("batchgen")

BAR_REFRESH_S = 1.0  # how often the bar is redrawn between finished rows
MIN_TICK_S = 0.05  # log_every_s=0 (tests) still leaves the job's thread most of the time


def terminal_columns(stream: TextIO) -> int | None:
    """The terminal's width, 0 when it reports none; None when `stream` is not a terminal."""
    try:
        if not stream.isatty():
            return None
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


class Progress:
    def __init__(self, total_rows: int | None, *, quiet: bool, log_every_s: float,
                 work: Callable[[], tuple[int, int | None]] | None = None, stream: TextIO | None = None):
        self.total_rows = total_rows
        self.work = work
        self.num_rows = 0
        self.num_errors = 0
        self.num_generated_tokens = 0
        self.started = time.monotonic()
        self._first_tokens: tuple[float, int] | None = None  # (when, how many) at the first line with tokens
        self.log_every_s = log_every_s
        stream = stream if stream is not None else sys.stderr
        self._bar: tqdm | None = None
        self._redirect = contextlib.ExitStack()
        if not quiet and terminal_columns(stream):
            self._bar = tqdm(total=None, unit="tok", dynamic_ncols=True, file=stream, bar_format="{postfix}")
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
        return time.monotonic() - self.started

    def _work(self) -> tuple[int, int | None]:
        """(tokens generated so far, predicted total or None): finished rows' tokens without `work`."""
        return self.work() if self.work is not None else (self.num_generated_tokens, None)

    def eta_s(self, tokens: int, predicted: int | None, elapsed_s: float) -> float | None:
        if predicted and tokens:
            first = self._first_tokens
            now = self.started + elapsed_s
            if first is not None and tokens > first[1] and now > first[0]:
                return (now - first[0]) * max(predicted - tokens, 0) / (tokens - first[1])
            return elapsed_s * max(predicted - tokens, 0) / tokens
        if self.total_rows and self.num_rows:
            return elapsed_s * (self.total_rows - self.num_rows) / self.num_rows
        return None

    def line(self) -> str:
        total = f"/{self.total_rows}" if self.total_rows is not None else ""
        tokens, predicted = self._work()
        elapsed = self.elapsed_s
        eta = self.eta_s(tokens, predicted, elapsed)
        if tokens and self._first_tokens is None:
            self._first_tokens = (self.started + elapsed, tokens)
        return (f"rows {self.num_rows}{total} ({self.num_errors} errors), {tokens} tokens, "
                f"{tokens / max(elapsed, 1e-9):.1f} tok/s{'' if eta is None else f', ETA {eta:.0f}s'}")

    def _tick(self) -> None:
        interval = BAR_REFRESH_S if self._bar is not None else max(self.log_every_s, MIN_TICK_S)
        while not self._stop.wait(interval):
            self._show()

    def _show(self) -> None:
        if self._bar is None:
            log.info("%s", self.line())
            return
        tokens, predicted = self._work()
        if predicted:
            self._bar.total = max(predicted, tokens)
            self._bar.bar_format = "{percentage:3.0f}%|{bar}| {postfix}"
        self._bar.n = tokens
        self._bar.set_postfix_str(self.line(), refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._stop.set()
        self._ticker.join()
        self._show()  # the last state: every row counted
        if self._bar is not None:
            self._bar.close()
        self._redirect.close()
