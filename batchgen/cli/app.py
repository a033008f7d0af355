"""The Typer app the commands register on, and `--version`.

rich_markup_mode=None: plain click help (batchgen/cli/help.py puts run's options in sections).
Rich markup reads the "[text]", "[auto]" defaults in the option help as style tags and drops
them, and its table cuts long flag names on 80 columns.
"""

from __future__ import annotations

from typing import Annotated

import typer

from batchgen import __version__

# -h as well as --help, in every command; shell completion (--install-completion) on
app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
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
