"""`batchgen plan`: the dry run's flags (every one of `run`'s, and its own); the work is jobs/commands/plan.py's."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from batchgen.cli import options as o
from batchgen.cli.app import app
from batchgen.cli.console import setup_logging, user_errors
from batchgen.cli.help import PanelCommand
from batchgen.cli.job_flags import job_command

# plan writes nothing: its --output is where a resume's rows and learned lengths are read from
PlanOutput = Annotated[str | None, typer.Option("--output", "-o", metavar="DIR", rich_help_panel="Output", help=(
    "The job's output directory, if it exists: only the rows a resume would run are planned, with its "
    "learned output lengths. Nothing is written."))]


@app.command(cls=PanelCommand)
@job_command(output=PlanOutput)
def plan(
    calibrate: Annotated[bool, typer.Option("--calibrate", rich_help_panel="Plan", help=(
        "Measure this machine: a short calibration run generates a few tokens for rows of the first window and "
        "stores the step costs for later plans of the same setup. Without it the time comes from the stored "
        "profile, else the built-in CPU one (rough), and nothing is generated."))] = False,
    calibration_rows: Annotated[int | None, typer.Option(metavar="N", rich_help_panel="Plan", help=(
        "Rows the calibration runs on; N > 0 implies --calibrate, 0 turns it off [16]."))] = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel="Plan", help="One JSON object on stdout.")] = False,
    **job,
) -> None:
    """Dry run: windows, prompt and predicted output lengths, mode per window and why, KV memory, time, output size.

    Loads the model and tokenizes every prompt; generates nothing unless --calibrate.

    Takes every `run` option, so a run command pasted here plans that job; those that do not change
    the plan (sampling, commits, metrics, executor) are checked as a run checks them, then ignored."""
    with user_errors():  # config_overrides reads escapes in --stop/--template, which can be malformed
        overrides = o.config_overrides(job)
        from batchgen.config.job import build_config
        from batchgen.jobs.commands.plan import plan_job, plan_lines  # imports torch only once the checks have passed

        job_config = build_config(job["config"], need_output=False, **overrides)
        setup_logging(quiet=True)
        report = plan_job(job_config, calibrate=calibrate if calibration_rows is None else calibration_rows > 0,
                          calibration_rows=calibration_rows or 16)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for line in plan_lines(report):
            typer.echo(line)
