"""What every command writes to the terminal besides its result: error lines, interrupts, logging.

User mistakes (BatchgenError) become one `error:` line on stderr and the error's exit code (the
table is in batchgen.errors). An interrupt before the job installed its own handlers (while
torch loads, say) becomes one line and exit 130 too. Anything else is a bug: exit 1 with the
traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import typer

from batchgen.errors import BatchgenError


class user_errors:
    """Turn BatchgenError into one line on stderr and its exit code; an interrupt into 130 / 143."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            return False
        if issubclass(exc_type, BatchgenError):
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        # KeyboardInterrupt: Ctrl-C before any handler of ours was installed (an import, say);
        # batchgen.jobs.pipeline.signals.Interrupt: one that a job's handler raised outside a job's own try
        signum = getattr(exc, "signum", signal.SIGINT)
        if issubclass(exc_type, KeyboardInterrupt) or type(exc).__name__ == "Interrupt":
            typer.echo(f"interrupted by {signal.Signals(signum).name} while starting up, before any row was "
                       "generated; nothing was committed", err=True)
            raise typer.Exit(code=128 + signum) from None
        return False


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is emitted, not as it was at set-up.

    basicConfig runs once per process; a handler bound to the first run's stderr breaks every later
    in-process run that swaps stderr (CliRunner, contextlib.redirect_stderr) with a closed stream.
    """

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(quiet: bool) -> None:
    """Log lines on stderr. With `quiet`, or without a terminal, no progress bar of anyone's: the
    GGUF reader in transformers draws one while it converts the default model, which in a log is a
    line of carriage returns. tqdm reads TQDM_DISABLE when it is imported, which in a command is
    after this (the heavy imports wait for the checks)."""
    level = os.environ.get("BATCHGEN_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, handlers=[_StderrHandler()], format="%(asctime)s %(levelname)s %(message)s")
    if quiet or not sys.stderr.isatty():
        os.environ["TQDM_DISABLE"] = "1"

