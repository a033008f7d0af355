"""A slow step of start-up said while it runs: a GGUF conversion, a model load, a kernel build.

Such a step runs for seconds to minutes before the first row, and transformers' own bars are off
in a job (they are noise in a log). Without a word the job looks hung, so a stage logs a line
when it begins, one every `every_s` seconds while it lasts, and the time it took when it ends.
Stages nest (a load that converts a GGUF first): only the innermost one ticks, so the log says
what is running now rather than every stage that encloses it.
"""

from __future__ import annotations

import logging
import threading
import time

HEARTBEAT_S = 10.0  # a line this often while a stage runs

_active: list[slow_stage] = []  # the stages running now, outermost first
_active_lock = threading.Lock()


class slow_stage:
    """`with slow_stage("converting x.gguf (once: about a minute)", logger=log): ...`"""

    def __init__(self, what: str, *, logger: logging.Logger, every_s: float | None = None,
                 done_level: int = logging.INFO):
        self.what = what
        self.logger = logger
        self.every_s = HEARTBEAT_S if every_s is None else every_s
        self.done_level = done_level
        self.started = 0.0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def __enter__(self) -> slow_stage:
        self.started = time.monotonic()
        self.logger.info("%s ...", self.what)
        with _active_lock:
            _active.append(self)
        self._ticker = threading.Thread(target=self._tick, name="batchgen-stage", daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if exc_type is None:
            self.logger.log(self.done_level, "%s: done in %.1f s", self.what, self.elapsed_s)
        # Leave the stack only after the last line: until then an enclosing stage must stay quiet, so
        # the log never shows the outer stage ticking before the inner one says it is done.
        with _active_lock:
            _active.remove(self)

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            with _active_lock:
                innermost = bool(_active) and _active[-1] is self
            if innermost:
                self.logger.info("%s: %.0f s so far", self.what, self.elapsed_s)
