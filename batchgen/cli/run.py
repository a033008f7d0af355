"""`batchgen run`: parse the flags, then hand the job to batchgen.jobs.commands.run.

Everything a user can get wrong (flags, config file, inputs, columns, template, output directory)
is checked before torch and transformers are imported, which alone takes seconds.
"""

from __future__ import annotations

import json

import typer

from batchgen.cli import options as o
from batchgen.cli.app import app
from batchgen.cli.console import setup_logging, user_errors
from batchgen.cli.help import PanelCommand
from batchgen.cli.job_flags import job_command


@app.command(cls=PanelCommand)
@job_command()
def run(**job) -> None:
    """Generate a completion for every input row and write Parquet parts to --output."""
    with user_errors():  # config_overrides reads escapes in --stop/--template, which can be malformed
        overrides = o.config_overrides(job)
        from batchgen.config.job import build_config
        from batchgen.jobs.commands.run import run_job  # imports torch only once the job's checks have passed

        job_config = build_config(job["config"], **overrides)
        setup_logging(job_config.quiet)
        workers = job_config.workers  # the flag, else the config file's `workers:`
        if workers is not None and workers > 1:
            from batchgen.jobs.executors.workers import run_workers

            result = run_workers(job_config, workers)
            typer.echo(f"done: {result['rows']} rows ({result['rows_error']} errors) by {workers} workers, "
                       f"finalized in {result['output']}", err=True)
            typer.echo(json.dumps({"output": result["output"], "rows": result["rows_run"],
                                   "errors": result["rows_error_run"],
                                   "output_rows": result["rows"], "output_errors": result["rows_error"],
                                   "workers": workers}))
            return
        summary = run_job(job_config)
    for line in summary.lines():
        typer.echo(line, err=True)
    typer.echo(json.dumps({"output": summary.output_dir, "rows": summary.num_rows, "errors": summary.num_rows_error,
                           "output_rows": summary.output_rows, "output_errors": summary.output_rows_error}))
