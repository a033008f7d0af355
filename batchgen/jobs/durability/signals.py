"""SIGTERM / SIGINT during a job: stop, commit what is finished, exit 143 / 130.

First signal: raise Interrupt in the main thread at once, which stops the engine between
two bytecodes (no new row is admitted, the running step is abandoned) and lets the job commit
the rows that already finished; the CLI then exits 128 + signum. Inside a critical section (a
commit, recovery) the exception waits until the section ends, so a commit is never cut in half
by our own handler. Second signal: os._exit at once. That is as safe as kill -9, which the
commit protocol survives by design (batchgen.io.manifest.manifest): committed parts are whole, and the
next run recovers or deletes whatever the exit left.

Interrupt derives from BaseException, like KeyboardInterrupt, so that no `except Exception` on
the way (model loading has one) swallows it; the job turns it into JobInterrupted (exit code)
once it has committed.

While the engine generates, the job defers the signal (`deferred()`): the handler only records
it, and the job raises Interrupt at the next step boundary (`raise_if_interrupted`, called
between engine steps), where every in-flight row's tokens and random state are whole, so they
can be checkpointed and continued exactly (batchgen.jobs.durability.inflight). A step takes well under a
second on a GPU, seconds at most on a CPU.

A grace budget bounds the time from the first signal to exit: after `grace_s` a timer thread
exits the process (as a second signal does), whatever is still running. A preemption notice
(Kubernetes' terminationGracePeriodSeconds, 30 s by default; a spot notice, 30 s to 2 min) ends
in SIGKILL anyway; exiting first, on our own terms, leaves nothing half done that the commit
protocol does not already survive. The job commits finished rows first and writes in-flight
checkpoints only with time left (`seconds_left`).

Handlers are installed only in the main thread (Python allows no other) and restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


DEFAULT_GRACE_S = 25.0  # fits a 30 s eviction notice with room for the process to be reaped


class SignalGuard:
    def __init__(self, grace_s: float | None = DEFAULT_GRACE_S) -> None:
        self.signum: int | None = None  # the first signal received
        self.grace_s = grace_s  # first signal -> exit at the latest; None: no limit
        self.deadline: float | None = None  # time.monotonic() by which the process exits
        self._depth = 0  # nesting of critical sections
        self._num_deferring = 0  # nesting of deferred() sections
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

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
        if self._depth == 0 and self._num_deferring == 0 and self.signum is not None:
            raise Interrupt(self.signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A section where the first signal is only recorded: the code inside raises it at a
        point of its choosing (`raise_if_interrupted`); on a normal exit it raises at the end."""
        self._num_deferring += 1
        try:
            yield
        finally:
            self._num_deferring -= 1
        if self._depth == 0 and self._num_deferring == 0:
            self.raise_if_interrupted()

    def raise_if_interrupted(self) -> None:
        if self.signum is not None:
            raise Interrupt(self.signum)

    def seconds_left(self) -> float:
        """Of the grace budget (infinite before a signal or without a limit)."""
        if self.deadline is None:
            return float("inf")
        return self.deadline - time.monotonic()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            _say(f"error: second signal ({name}): exiting now; rerun the command to resume\n")  # the last line
            os._exit(128 + self.signum)
        self.signum = signum
        grace = f" within {self.grace_s:g} s" if self.grace_s is not None else ""
        _say(f"batchgen: {name}: stopping{grace}: committing finished rows, then checkpointing rows in flight "
             "(signal again to exit at once)\n")
        if self.grace_s is not None:
            self.deadline = time.monotonic() + self.grace_s
            self._timer = threading.Timer(self.grace_s, _exit_after_grace, (signum, self.grace_s))
            self._timer.daemon = True
            self._timer.start()
        if self._depth == 0 and self._num_deferring == 0:
            raise Interrupt(signum)


def _exit_after_grace(signum: int, grace_s: float) -> None:
    _say(f"error: still stopping {grace_s:g} s after the signal (--stop-grace-seconds): exiting now; "
         "rerun the command to resume\n")
    os._exit(128 + signum)


def _say(text: str) -> None:
    try:  # os.write, not logging or print: a handler may run while either holds its lock
        os.write(2, text.encode())
    except OSError:
        pass
