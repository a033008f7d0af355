"""The Typer app the commands register on, and `--version`.

rich_markup_mode=None: plain click help (batchgen/cli/help.py puts run's options in sections).
Rich markup reads the "[text]", "[auto]" defaults in the option help as style tags and drops
them, and its table cuts long flag names on 80 columns.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from batchgen import __version__
from batchgen.cli.console import CLICK_ERRORS, usage_line

# click's own help for a command given no arguments travels as a usage error too (click >= 8.2)
_HELP_ERRORS = tuple(getattr(CLICK_ERRORS, name) for name in ("NoArgsIsHelpError",) if hasattr(CLICK_ERRORS, name))


class _UsageLine(CLICK_ERRORS.UsageError):
    """A usage error already worded as batchgen's one `error:` line (exit 2, as click's own)."""

    def show(self, file=None) -> None:
        typer.echo(self.message, file=file, err=True)


class OneLineErrors(TyperGroup):
    """The commands' group: click's usage errors (a flag's value of the wrong type, an unknown flag
    or command) become one `error:` line (batchgen.cli.console.usage_line) instead of click's usage
    block, so that every mistake a user makes reads the same way."""

    argv: list[str] = []

    def main(self, args=None, *rest, **kwargs):
        self.argv = [str(a) for a in (sys.argv[1:] if args is None else args)]  # for the value a flag was given
        return super().main(args, *rest, **kwargs)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except CLICK_ERRORS.UsageError as e:
            raise self._one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CLICK_ERRORS.UsageError as e:
            raise self._one_line(e) from None

    def _one_line(self, error: Exception) -> Exception:
        if isinstance(error, (_UsageLine, *_HELP_ERRORS)):  # a help error prints the help
            return error
        return _UsageLine(usage_line(error, self.argv), ctx=error.ctx)


# -h as well as --help, in every command; shell completion (--install-completion) on
app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Offline batch LLM generation: Parquet/JSONL prompts in, Parquet out.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"batchgen {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """batchgen pushes millions of prompts through a causal LM and never loses a row."""
