"""`batchgen report`: one HTML page of a job's figures, from its _metrics/ and manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from batchgen.cli.app import app
from batchgen.cli.console import user_errors


@app.command()
def report(
    output_dir: Annotated[Path, typer.Argument(help="Output directory of a job: finished, running "
                                               "or killed.")],
    to: Annotated[Path | None, typer.Option("--to", metavar="DIR", help="Directory for report.html (and the PNGs) "
                  "[OUTPUT_DIR/_report].")] = None,
    png: Annotated[bool, typer.Option("--png", help="Also write each figure as a PNG file.")] = False,
) -> None:
    """One HTML page of a job's figures: throughput, batch and KV use, step times, lengths, shards, errors."""
    with user_errors():
        from batchgen.monitor.report import render_job_report

        files = render_job_report(output_dir, dest=to, png=png)
    typer.echo(json.dumps({"html": str(files.html_path), "png": [str(p) for p in files.png_paths]}))
