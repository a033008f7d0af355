"""`batchgen status` and `batchgen compact`: commands over a job's output directory (no model)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from batchgen.cli.app import app
from batchgen.cli.console import setup_logging, user_errors


@app.command()
def status(
    output: Annotated[str, typer.Option("--output", "-o", metavar="DIR", help="Output directory of a job.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object (for Airflow sensors and scripts).")]
    = False,
) -> None:
    """Rows done, errored and remaining per input file, the config fingerprint, the last commit."""
    with user_errors():
        from batchgen.jobs.commands.status import job_status, status_lines

        result = job_status(output)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for line in status_lines(result):
            typer.echo(line)


@app.command()
def compact(
    output: Annotated[str, typer.Option("--output", "-o", metavar="DIR", help="Output directory of a finished job.")],
) -> None:
    """Rewrite a finished output directory as one part per input file, rows in input order."""
    with user_errors():
        from batchgen.jobs.commands.compact import compact_output

        setup_logging(quiet=False)
        result = compact_output(output)
    typer.echo(json.dumps({"output": result.output_dir, "parts_before": result.num_parts_before,
                           "parts_after": result.num_parts_after, "rows": result.num_rows}))
