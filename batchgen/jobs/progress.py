"""Progress of a job: a tqdm bar on a terminal, a log line every N seconds otherwise."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("batchgen")


class Progress:
    def __init__(self, total_rows: int | None, *, quiet: bool, log_every_s: float):
        self.total_rows = total_rows
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
            self._bar.set_postfix(tok_s=f"{self.tokens_per_s:.1f}", errors=self.num_errors, refresh=False)
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            log.info("%s", self.line())

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / max(self.elapsed_s, 1e-9)

    def line(self) -> str:
        total = f"/{self.total_rows}" if self.total_rows is not None else ""
        eta = ""
        if self.total_rows and self.num_rows:
            remaining_s = self.elapsed_s * (self.total_rows - self.num_rows) / self.num_rows
            eta = f", ETA {remaining_s:.0f}s"
        return (f"rows {self.num_rows}{total} ({self.num_errors} errors), "
                f"{self.num_generated_tokens} tokens, {self.tokens_per_s:.1f} tok/s{eta}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
