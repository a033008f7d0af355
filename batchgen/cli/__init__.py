"""The `batchgen` command line: thin Typer commands over batchgen.jobs.

    app.py       the Typer app and --version
    options.py   every option `run` and `plan` share (flag, metavar, help) and the config overrides
    console.py   error lines, exit codes for interrupts, logging set-up
    run.py, plan.py, status.py (status, compact), finalize.py, bench.py, report.py: one command each

A command imports its job module inside its body, so `batchgen --help` and every check of a
command's flags and inputs run without importing torch.
"""

from __future__ import annotations

import sys

from batchgen.cli import bench, finalize, plan, report, run, status  # noqa: F401  (each registers its command on `app`)
from batchgen.cli.app import app
from batchgen.cli.console import catch_interrupts
from batchgen.runtime import heap, omp, onednn_cache

__all__ = ["app", "main"]


# commands whose forward runs many OpenMP regions: worth the wait policy's 0.15 s look at the machine
GENERATING_COMMANDS = ("run", "bench", "plan")


def main() -> None:
    catch_interrupts()  # first: a background job of a script starts with SIGINT ignored
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    omp.apply_defaults(sample=command in GENERATING_COMMANDS)  # before any command imports torch
    onednn_cache.apply_defaults()  # before the first forward builds a kernel
    if command in GENERATING_COMMANDS:
        heap.keep_freed_pages()  # a step's activations reuse the last step's pages
    app()
