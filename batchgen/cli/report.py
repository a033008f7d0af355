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
    output_dir: Annotated[str, typer.Argument(help="Output directory of a job (or s3:// prefix): finished, "
                                              "running or killed; a sharded job's gets one page over its shards.")],
    to: Annotated[Path | None, typer.Option("--to", metavar="DIR", help="Local directory for report.html (and the "
                  "PNGs) [OUTPUT_DIR/_report, in the store for an s3:// output].")] = None,
    png: Annotated[bool, typer.Option("--png", help="Also write each figure as a PNG file.")] = False,
) -> None:
    """One HTML page of a job's figures: throughput, batch and KV use, step times, lengths, rows per
    planning window (per shard for a sharded job), errors."""
    with user_errors():
        from batchgen.jobs.commands.report import render_report

        files = render_report(output_dir, dest=to, png=png)
    typer.echo(json.dumps({"html": str(files.html_path), "png": [str(p) for p in files.png_paths]}))
