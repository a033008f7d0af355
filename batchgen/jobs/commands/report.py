"""`batchgen report` over any output (`render_report`), and a sharded job's page: the whole job, a line per shard.

One job's page is batchgen.monitor.report's; this module lives in jobs/ because a sharded job's
set of shard directories is read by batchgen.jobs.sharding.sharded (monitor/ does not import jobs/).

The shards ran as separate processes (often at the same time, on other machines). Their metrics
records are put together: the throughput over time is the job's (the shards' tokens per second
added up in each time bin), the step-time histogram and the length sample hold every shard's
steps and rows. One job's "rows per window" figure becomes rows per job shard (ok, error,
remaining, from the manifests), and the error reasons are counted over every shard's committed
parts. A shard on an object store keeps no metrics (batchgen.jobs.executors.local): its share of the time
series is empty, and its line and the row figures still come from its manifest.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pyarrow as pa

from batchgen.io.manifest.manifest import load_manifest
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.jobs.commands.status import sharded_status
from batchgen.jobs.sharding.sharded import is_sharded_output, list_shard_dirs
from batchgen.monitor import figures
from batchgen.monitor.html import Figure, Report, ReportFiles
from batchgen.monitor.records import SCHEMAS
from batchgen.monitor.report import (
    batch_and_kv_figure,
    error_reasons,
    errors_figure,
    job_metrics,
    lengths_figure,
    output_where,
    read_summary,
    render_job_report,
    save_report,
    step_times_figure,
    time_unit,
    tokens_per_s_figure,
)
from batchgen.monitor.totals import Totals

STATES = {"complete": "complete (finalized: the job's _SUCCESS is written)",
          "unfinalized": "every shard complete; run `batchgen finalize --output DIR` to mark the job done",
          "incomplete": "incomplete: run (or rerun, to resume) the shards not complete, then `batchgen finalize`",
          "running": "running"}


def render_report(output: str | Path | OutputStore, *, dest: str | Path | None = None,
                  png: bool = False) -> ReportFiles:
    """The page of OUTPUT: a sharded job's over its shards, else the one job's (batchgen.monitor.report);
    written to `dest`, else OUTPUT/_report/ (into the store for an object-store OUTPUT)."""
    store = open_store(output)
    if not is_sharded_output(store):
        return render_job_report(store, dest=dest, png=png)
    return save_report(build_sharded_report(store), store, dest, png=png)


def build_sharded_report(store: OutputStore) -> Report:
    status = sharded_status(store)
    by_index = {d.index: d for d in list_shard_dirs(store) if d.num_shards == status["num_shards"]}
    steps, rows, totals, reasons = [], [], Totals(), Counter()
    shard_facts = []
    for shard in status["job_shards"]:
        shard_dir = by_index.get(shard["index"])
        if shard_dir is None or shard["state"] == "not started":
            shard_facts.append((f"shard {shard['index']}", "not started"))
            continue
        shard_steps, shard_rows, shard_totals = job_metrics(shard_dir.store)
        steps.append(shard_steps)
        rows.append(shard_rows)
        totals = _add(totals, shard_totals)
        reasons += error_reasons(shard_dir.store, load_manifest(shard_dir.store))  # one shard's ids at a time
        shard_facts.append((f"shard {shard['index']}", _shard_line(shard, read_summary(shard_dir.store))))
    steps_table = pa.concat_tables(steps).sort_by("time_s") if steps else SCHEMAS["steps"].empty_table()
    rows_table = pa.concat_tables(rows) if rows else SCHEMAS["rows"].empty_table()
    t0 = min((t["time_s"][0].as_py() for t in (steps_table, rows_table) if t.num_rows), default=0)
    unit = time_unit(steps_table["time_s"][-1].as_py() + 1 - t0 if steps_table.num_rows else 0)
    figs = [tokens_per_s_figure(steps_table, t0, [], unit), batch_and_kv_figure(steps_table, t0, [], unit),
            step_times_figure(steps_table), lengths_figure(rows_table), _rows_per_job_shard(status),
            errors_figure(reasons)]
    state = STATES.get(status["state"], status["state"])
    if status["state"] == "running":
        state = f"running ({len(status['running'])} shards hold their lock or lease)"
    total = "?" if status["rows"] is None else status["rows"]
    fingerprint = ("the shards' fingerprints differ (finalize will refuse)" if status["fingerprints_differ"]
                   else (status["fingerprint"] or {}).get("digest") or "none yet")
    facts = [("state", state),
             ("shards", f"{status['num_shards']} ({status['shards_complete']} complete)"),
             ("rows committed", f"{status['done'] + status['errored']} of {total} ({status['errored']} error rows)"),
             ("tokens generated (all shards, all runs)", f"{totals.num_generated_tokens:,}"),
             ("engine steps (all shards, all runs)", f"{totals.num_engine_steps:,} in {totals.engine_seconds:,.1f} s "
                                                     f"of engine time, {totals.num_preemptions} preemptions"),
             ("fingerprint", fingerprint), *shard_facts]
    notes = ["Time axes count from the first metrics record of any shard; shards that ran at the same time add "
             "up in the throughput figure. Metrics are flushed every few seconds, so a killed shard's last seconds "
             "may be missing."]
    if not isinstance(store, LocalStore):
        notes.append("Shards on an object store keep no metrics files: the time series and histograms are empty.")
    return Report(title=f"batchgen sharded job: {store.name}", subtitle=output_where(store), facts=facts, figures=figs,
                  notes=notes)


def _add(a: Totals, b: Totals) -> Totals:
    return Totals(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(Totals)})


def _shard_line(shard: dict, summary: dict | None) -> str:
    rows = "?" if shard["rows"] is None else shard["rows"]
    line = f"{shard['state']}, {shard['done'] + shard['errored']} of {rows} rows committed ({shard['errored']} errors)"
    if summary:
        line += (f"; last run {summary.get('num_rows')} rows in {summary.get('wall_seconds', 0):.1f} s, "
                 f"{summary.get('generated_tokens_per_s')} tok/s")
    return line


def _rows_per_job_shard(status: dict) -> Figure:
    shards = status["job_shards"]
    stacks = {"ok": [s["done"] for s in shards], "error": [s["errored"] for s in shards],
              "remaining": [s["remaining"] or 0 for s in shards]}
    png = figures.stacked_bars("Rows per job shard", "job shard (--shard-index)", "rows",
                               [str(s["index"]) for s in shards], stacks)
    return Figure("rows_per_job_shard", "Rows per job shard", "Committed ok and error rows of each shard, and the "
                  "rows it has left (unknown for a shard not started). Even bars are the split at work; a short "
                  "one is a shard to run or resume.", png)
