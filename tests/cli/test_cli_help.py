"""--help (and -h) of the commands: run's and plan's options in named sections."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.cli.help import OTHER, PANELS

runner = CliRunner()


@pytest.mark.parametrize("command", [[], ["run"], ["plan"], ["status"], ["finalize"], ["compact"]])
def test_dash_h_is_help(command):
    short, long = runner.invoke(app, [*command, "-h"]), runner.invoke(app, [*command, "--help"])
    assert short.exit_code == 0 and short.output == long.output and "Usage:" in short.output


def test_shell_completion_is_offered():
    assert "--install-completion" in runner.invoke(app, ["--help"]).output


@pytest.mark.parametrize("command", ["run", "plan"])
def test_every_option_has_a_section_in_order(command):
    params = typer.main.get_command(app).commands[command].params
    unsorted = [p.opts[0] for p in params if getattr(p, "rich_help_panel", None) is None]
    assert unsorted == ["--config"], unsorted  # and --help, which click adds
    text = runner.invoke(app, [command, "--help"]).output
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == [p for p in (*PANELS, OTHER) if f"\n{p}:\n" in text]
    for heading, flag in (("Sampling", "--temperature"), ("Model", "--quantize"), ("Input", "--prompt-column"),
                          ("Output", "--commit-every-seconds"), ("Engine", "--kv-cache-dtype")):
        section = text[text.index(f"\n{heading}:\n"):]
        section = section[:section.index("\n\n", 2)] if "\n\n" in section[2:] else section
        assert flag in section, (heading, flag)
