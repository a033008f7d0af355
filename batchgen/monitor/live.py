"""Live figures of a job from its metrics files, for `batchgen status --json` (an Airflow sensor, a
shell loop): prompt and generated tokens/s over the last minute, the ETA, the latest batch and KV
usage.

Read-only and cheap: only the newest segments are read (those that reach into the last minute
of records). The files trail the job by at most one flush interval, so the figures are as of
`metrics_time`, and the ETA is counted down from then while the job is still running. A job
that no run is running has nothing in flight: no running sequences, and an ETA of 0 once it is
complete, none (unknown until a run resumes it) otherwise.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.monitor.eta import RATE_WINDOW_S
from batchgen.monitor.store import list_segments, metrics_dir, read_kind
from batchgen.monitor.totals import Totals

COLUMNS = ["time_s", "num_sampled_tokens", "num_prompt_tokens", "num_running_sum", "num_steps", "num_kv_blocks_used",
           "num_kv_blocks_total", "eta_seconds"]


def recent_steps(directory: Path, window_s: int = RATE_WINDOW_S) -> pa.Table:
    """The steps records of the last `window_s` seconds before the newest one."""
    segments = list_segments(directory, "steps")
    tables = []
    for seg in reversed(segments):
        table = read_kind(directory, "steps", columns=COLUMNS, segments=[seg])
        if table.num_rows:
            tables.append(table)
            newest = max(t["time_s"].to_pylist()[-1] for t in tables)
            if table["time_s"][0].as_py() <= newest - window_s:
                break
    if not tables:
        return pa.schema([]).empty_table()
    table = pa.concat_tables(reversed(tables))
    newest = table["time_s"].to_pylist()[-1]
    return table.filter(pc.greater(table["time_s"], newest - window_s))


def live_figures(out_dir: str | Path, *, running: bool, complete: bool = False) -> dict[str, Any] | None:
    """None when the job has no metrics files (--no-metrics, or no step yet)."""
    directory = metrics_dir(out_dir)
    table = recent_steps(directory)
    if not table.num_rows:
        return None
    rows = table.to_pylist()
    last = rows[-1]
    span_s = last["time_s"] + 1 - rows[0]["time_s"]
    metrics_time = last["time_s"] + 1  # the end of the newest second on disk
    eta = last["eta_seconds"]
    if not running:
        eta = 0.0 if complete else None
    elif eta is not None:
        eta = max(0.0, eta - max(0.0, time.time() - metrics_time))
    totals = Totals.from_dir(directory)
    return {
        "metrics_time": metrics_time,
        "tokens_per_s_last_minute": round(sum(r["num_sampled_tokens"] for r in rows) / span_s, 2),
        # prompt tokens prefilled (null in records written before they were counted)
        "input_tokens_per_s_last_minute": round(sum(r["num_prompt_tokens"] or 0 for r in rows) / span_s, 2),
        "eta_seconds": None if eta is None else round(eta, 1),
        "running_sequences": round(last["num_running_sum"] / last["num_steps"], 1)
        if running and last["num_steps"] else 0,
        "kv_cache_usage": round(last["num_kv_blocks_used"] / last["num_kv_blocks_total"], 4)
        if last["num_kv_blocks_total"] else None,
        "tokens_generated": totals.num_generated_tokens,
        "engine_steps": totals.num_engine_steps,
        "rows_finished": totals.num_rows,
    }
