"""What every command writes to the terminal besides its result: error lines, interrupts, logging.

User mistakes (BatchgenError) become one `error:` line on stderr and the error's exit code (the
table is in batchgen.errors); so do click's own usage errors (a flag's value of the wrong type,
an unknown flag or command: usage_line), exit 2, with the name a typo most likely meant. An
interrupt before the job installed its own handlers (while torch loads, say) becomes one such
line and exit 130 too. Anything else is a bug: exit 1 with the traceback.

Python turns SIGINT into KeyboardInterrupt only if the process did not start with SIGINT ignored,
and bash starts a script's background jobs (`batchgen run ... &`) with it ignored: such a job
would sit through a SIGINT until the job's own handler is installed, seconds to minutes later,
then honour the next one. `catch_interrupts` installs the handler at start-up instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import sys

import typer

from batchgen.config.suggest import closest
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
        # batchgen.jobs.durability.signals.Interrupt: one that a job's handler raised outside a job's own try
        signum = getattr(exc, "signum", signal.SIGINT)
        if issubclass(exc_type, KeyboardInterrupt) or type(exc).__name__ == "Interrupt":
            typer.echo(f"error: interrupted by {signal.Signals(signum).name} while starting up, before any row was "
                       "generated; nothing was committed", err=True)
            raise typer.Exit(code=128 + signum) from None
        return False


# the click the commands run on: typer's own copy in recent typer, the click package before it
CLICK_ERRORS = importlib.import_module(typer.BadParameter.__module__)
# what a flag's type check says it wanted, in the words of batchgen's own checks
_WANTED = (("valid number", "a number"), ("valid integer", "a whole number"), ("valid boolean", "true or false"))


def usage_line(error: Exception, argv: list[str]) -> str:
    """One of click's usage errors as the one line every other mistake gets: which flag, what it
    takes and what it was given (from `argv`, the command line), and the flag, command or value a
    typo most likely meant."""
    if isinstance(error, CLICK_ERRORS.NoSuchOption):
        meant = closest(error.option_name, error.possibilities or [])
        hint = (f"; did you mean {meant}?" if meant is not None else
                f"; `{error.ctx.command_path} -h` lists the options" if error.ctx is not None else "")
        return f"error: no such option {error.option_name}{hint}"
    command = getattr(error, "command_name", None)  # click's NoSuchCommand
    if command is not None:
        meant = closest(command, getattr(error, "possibilities", None) or [])
        return f"error: no such command {command!r}" + (f"; did you mean {meant!r}?" if meant is not None else "")
    is_option = getattr(getattr(error, "param", None), "param_type_name", None) == "option"
    if isinstance(error, CLICK_ERRORS.MissingParameter) and is_option:
        return f"error: {max(error.param.opts, key=len)} is required"
    if isinstance(error, CLICK_ERRORS.BadParameter) and is_option:
        flag = max(error.param.opts, key=len)
        given = _given(argv, [*error.param.opts, *error.param.secondary_opts])
        got = f"; got {given!r}" if given is not None else ""
        wanted = next((words for phrase, words in _WANTED if phrase in error.message.lower()), None)
        if wanted is not None:
            return f"error: {flag} must be {wanted}{got}"
        return f"error: {flag}: {_sentence(error.message)}" + (got if given is not None and repr(given)
                                                                   not in error.message else "")
    return f"error: {_sentence(error.format_message())}"


def _given(argv: list[str], opts: list[str]) -> str | None:
    """The value the command line gave one of `opts` last (`--flag value` or `--flag=value`)."""
    value = None
    for i, word in enumerate(argv):
        if word in opts and i + 1 < len(argv):
            value = argv[i + 1]
        elif "=" in word and word.split("=", 1)[0] in opts:
            value = word.split("=", 1)[1]
    return value


def _sentence(message: str) -> str:
    """click's capitalized, full-stopped message as the rest of an `error:` line."""
    message = re.sub(r"\.\s+Did you mean", "; did you mean", message.strip()).rstrip(".")
    return message[:1].lower() + message[1:] if message[1:2].islower() else message


def catch_interrupts() -> None:
    """SIGINT raises KeyboardInterrupt from the first line on, whatever the parent left it set to."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


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

