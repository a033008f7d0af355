"""Progress of a job: a tqdm bar on a terminal, a log line every N seconds otherwise.

Tokens/s and the ETA in the log line count work, not finished rows: rows run longest predicted
output first, so in a shard's first minutes few rows finish while every slot generates. With a
`work` callable (tokens generated so far, in flight included; the job's predicted total) the ETA
is elapsed x (total - done) / done; without it, rows stand in for work.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

log = logging.getLogger("batchgen")


class Progress:
    def __init__(self, total_rows: int | None, *, quiet: bool, log_every_s: float,
                 work: Callable[[], tuple[int, int | None]] | None = None):
        self.total_rows = total_rows
        self.work = work
        self.num_rows = 0
        self.num_errors = 0
        self.num_generated_tokens = 0
        self.started = time.monotonic()
        self.log_every_s = log_every_s
        self._last_log = self.started
        use_bar = not quiet and sys.stderr.isatty()
        self._bar = tqdm(total=total_rows, unit="row", dynamic_ncols=True, file=sys.stderr) if use_bar else None

    def update(self, *, num_generated_tokens: int = 0, error: bool = False) -> None:
        self.num_rows += 1
        self.num_errors += int(error)
        self.num_generated_tokens += num_generated_tokens
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(1)
            tokens, _ = self._work()
            self._bar.set_postfix(tok_s=f"{tokens / max(now - self.started, 1e-9):.1f}", errors=self.num_errors,
                                  refresh=False)
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            log.info("%s", self.line())

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def _work(self) -> tuple[int, int | None]:
        """(tokens generated so far, predicted total or None): finished rows' tokens without `work`."""
        return self.work() if self.work is not None else (self.num_generated_tokens, None)

    def line(self) -> str:
        total = f"/{self.total_rows}" if self.total_rows is not None else ""
        tokens, predicted = self._work()
        elapsed = self.elapsed_s
        eta = ""
        if predicted and tokens:
            eta = f", ETA {elapsed * max(predicted - tokens, 0) / tokens:.0f}s"
        elif self.total_rows and self.num_rows:
            eta = f", ETA {elapsed * (self.total_rows - self.num_rows) / self.num_rows:.0f}s"
        return (f"rows {self.num_rows}{total} ({self.num_errors} errors), "
                f"{tokens} tokens, {tokens / max(elapsed, 1e-9):.1f} tok/s{eta}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
