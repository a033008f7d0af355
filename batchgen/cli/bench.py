"""`batchgen bench`: the engine's throughput on this machine, continuous against static batching."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from batchgen.cli.app import app
from batchgen.cli.console import setup_logging, user_errors


@app.command()
def bench(
    model: Annotated[str | None, typer.Option(metavar="MODEL", help="HF model id, local dir or .gguf "
                                              "[embedded model].")] = None,
    num_requests: Annotated[int, typer.Option(metavar="N", help="Requests in the workload.")] = 128,
    prompt_tokens: Annotated[int, typer.Option(metavar="N", help="Mean prompt length in tokens.")] = 128,
    output_tokens: Annotated[int, typer.Option(metavar="N", help="Mean output length in tokens (ignore-EOS).")] = 128,
    uniform: Annotated[bool, typer.Option("--uniform/--mixed", help="Equal lengths, or heavy-tailed "
                       "log-normal ones [mixed].")] = False,
    batch_size: Annotated[int, typer.Option(metavar="N", help="Sequences running at once.")] = 128,
    max_num_batched_tokens: Annotated[int, typer.Option(metavar="N", help="Token budget per engine step.")] = 2048,
    kv_cache_memory: Annotated[str | None, typer.Option(metavar="SIZE", help="KV cache size, e.g. 2GiB "
                                                        "[auto].")] = None,
    repeats: Annotated[int, typer.Option(metavar="N", help="Rounds; each policy runs once per round.")] = 2,
    device: Annotated[str, typer.Option(metavar="DEVICE", help="auto | cpu | cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(metavar="DTYPE", help="auto | float32 | bfloat16 | float16.")] = "auto",
    report: Annotated[Path | None, typer.Option("--report", metavar="DIR", help="Also write an HTML report of "
                      "the comparison (figures side by side) to this directory.")] = None,
    png: Annotated[bool, typer.Option("--png", help="With --report: each figure as a PNG file too.")] = False,
) -> None:
    """Measure engine throughput here: continuous against static batching, round-robin."""
    with user_errors():
        from batchgen.config.job import parse_bytes
        from batchgen.jobs.commands.bench import bench_model

        setup_logging(quiet=True)
        outcome = bench_model(model, device=device, dtype=dtype, num_requests=num_requests,
                              prompt_tokens=prompt_tokens, output_tokens=output_tokens, uniform=uniform,
                              batch_size=batch_size, max_num_batched_tokens=max_num_batched_tokens,
                              kv_cache_bytes=parse_bytes(kv_cache_memory) if kv_cache_memory else None,
                              repeats=repeats, trace=report is not None)
        workload, result = outcome.workload, outcome.result
        if report is not None:
            from batchgen.monitor.bench_report import render_bench_report

            facts = [("model", outcome.model_label),
                     ("workload", f"{num_requests} requests, {workload.num_output_tokens} output tokens, "
                                  f"{'uniform' if uniform else 'mixed'} lengths, {repeats} rounds")]
            files = render_bench_report(result, outcome.traces, report, facts=facts, png=png)
            typer.echo(f"report: {files.html_path}", err=True)
    typer.echo(f"{outcome.model_label}: {num_requests} "
               f"requests, {workload.num_output_tokens} output tokens, {'uniform' if uniform else 'mixed'}", err=True)
    for name, r in result.items():
        typer.echo(f"{name:>10}: median {r['tokens_per_s_median']:.1f} tok/s, min {r['tokens_per_s_min']:.1f} "
                   f"({len(r['runs'])} runs)", err=True)
    typer.echo(json.dumps(result))
