"""`batchgen finalize`: mark a sharded job done once its shards form one complete job (no model)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from batchgen.cli.app import app
from batchgen.cli.console import user_errors


@app.command()
def finalize(
    output: Annotated[str, typer.Option("--output", "-o", metavar="DIR", help=(
        "Output directory of a sharded job (the --output its shards were run with).")) ],
) -> None:
    """Check every shard of a sharded job (present, complete, same fingerprint and inputs, no row twice),
    then write the job's _SUCCESS and _summary.json. Exit 4 names a shard to run or resume."""
    with user_errors():
        from batchgen.jobs.sharding.finalize import finalize_output

        result = finalize_output(output)
    typer.echo(f"{result['output']}: {result['num_shards']} shards, {result['rows']} rows "
               f"({result['rows_error']} errors), fingerprint {result['fingerprint']}: _SUCCESS written", err=True)
    typer.echo(json.dumps({"output": result["output"], "num_shards": result["num_shards"], "rows": result["rows"],
                           "errors": result["rows_error"], "fingerprint": result["fingerprint"]}))
