"""SIGTERM / SIGINT during a job: stop, commit what is finished, exit 143 / 130.

First signal: raise Interrupt in the main thread at once, which stops the engine between
two bytecodes (no new row is admitted, the running step is abandoned) and lets the job commit
the rows that already finished; the CLI then exits 128 + signum. Inside a critical section (a
commit, recovery) the exception waits until the section ends, so a commit is never cut in half
by our own handler. Second signal: os._exit at once. That is as safe as kill -9, which the
commit protocol survives by design (batchgen.io.manifest): committed parts are whole, and the
next run recovers or deletes whatever the exit left.

Interrupt derives from BaseException, like KeyboardInterrupt, so that no `except Exception` on
the way (model loading has one) swallows it; the job turns it into JobInterrupted (exit code)
once it has committed.

Handlers are installed only in the main thread (Python allows no other) and restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self._depth = 0  # nesting of critical sections
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section the first signal must not cut; it raises when the section ends instead."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self.signum is not None:
            raise Interrupt(self.signum)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            _say(f"batchgen: second signal ({name}): exiting now; rerun the command to resume\n")
            os._exit(128 + self.signum)
        self.signum = signum
        _say(f"batchgen: {name}: stopping, committing finished rows (signal again to exit at once)\n")
        if self._depth == 0:
            raise Interrupt(signum)


def _say(text: str) -> None:
    try:  # os.write, not logging or print: a handler may run while either holds its lock
        os.write(2, text.encode())
    except OSError:
        pass
