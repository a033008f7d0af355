"""The Typer app the commands register on, and `--version`.

rich_markup_mode=None: plain click help. Rich markup reads the "[text]", "[auto]" defaults in the
option help as style tags and drops them, and its table cuts long flag names on 80 columns.
"""

from __future__ import annotations

from typing import Annotated

import typer

from batchgen import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
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
