"""`run`'s and `plan`'s shared flags come from one table: a command built on it takes every job flag, in the
table's order, then its own; an option alias left out of the table is caught here, not by a user."""

from __future__ import annotations

import typing
from typing import Annotated

import typer
import typer.main
from typer.models import OptionInfo
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.cli import options as o
from batchgen.cli.job_flags import JOB_FLAGS, job_command


def _is_option(value) -> bool:
    return typing.get_origin(value) is Annotated and any(isinstance(m, OptionInfo) for m in value.__metadata__)


def test_every_option_alias_is_a_job_flag():
    aliases = {name for name, value in vars(o).items() if _is_option(value)}
    assert aliases == {option_name for option_name, value in vars(o).items() if value in JOB_FLAGS.values()}
    assert len(JOB_FLAGS) == len(aliases)


def test_run_and_plan_list_the_table_in_order():
    commands = typer.main.get_command(app).commands
    assert [p.name for p in commands["run"].params] == list(JOB_FLAGS)
    assert [p.name for p in commands["plan"].params] == [*JOB_FLAGS, "calibrate", "calibration_rows", "as_json"]


def test_a_job_command_gets_every_flag_its_own_and_a_replaced_one():
    seen = {}
    mine = typer.Typer()
    replaced = Annotated[str | None, typer.Option("--output", metavar="DIR", help="read, never written")]

    @mine.command()
    @job_command(output=replaced)
    def cmd(rounds: Annotated[int, typer.Option(help="its own")] = 1, **job) -> None:
        """A command of the test's."""
        seen.update(job, rounds=rounds)

    @mine.command()
    def other() -> None:  # a second command, so that Typer keeps the command name
        pass

    result = CliRunner().invoke(mine, ["cmd", "--output", "d", "--temperature", "0.5", "--rounds", "3"])
    assert result.exit_code == 0, result.output
    assert (seen.pop("rounds"), seen.pop("output"), seen.pop("temperature")) == (3, "d", 0.5)
    assert set(seen) == set(JOB_FLAGS) - {"output", "temperature"} and not any(seen.values())
    help_text = CliRunner().invoke(mine, ["cmd", "--help"]).output
    assert "read, never written" in help_text and "A command of the test's." in help_text
