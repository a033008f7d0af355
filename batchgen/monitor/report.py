"""`batchgen report OUTPUT_DIR`: one HTML page (and PNGs) of a job, finished, running or killed.

Everything comes from files the job leaves as it goes: `_metrics/` (engine steps, finished rows
and commits per second, over every run of a resumed job), the manifest (rows committed, state),
`_summary.json` (the last run that ended) and the committed parts' `error` column (error rows by
reason). Nothing is locked or written inside the output directory except the report itself
(`OUTPUT_DIR/_report/` unless `--to` says otherwise), so it is safe while the job runs.

An object-store output (s3://...) keeps no `_metrics/` (batchgen.jobs.executors.local): its page holds the
manifest's and summary's figures, and is written into the store's `_report/` unless `--to` names a
local directory. A sharded job's OUTPUT gets one page over all its shards
(batchgen.jobs.commands.report, which reuses the figures here).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.engine.metrics import LogHistogram
from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE, is_job_dir, load_manifest
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.monitor import figures
from batchgen.monitor.html import Figure, Report, ReportFiles, upload_report, write_report
from batchgen.monitor.records import SCHEMAS
from batchgen.monitor.store import metrics_dir, read_kind
from batchgen.monitor.totals import Totals

REPORT_DIR = "_report"
SUMMARY_FILE = "_summary.json"
MAX_POINTS = 2000  # time series are binned to at most this many points
MAX_ERROR_REASONS = 12
# a number standing alone in an error message (a count, a length, an id): not one inside a name,
# such as /v1/embeddings or bf16, whose digit tells one reason from another
NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d+(?:\.\d+)?")
REJECTED = "rejected before planning"  # rows records without a window: failed before the planner saw them
GAP_S = 30  # no engine step for this long: the job was not generating (loading, between runs)


def render_job_report(out_dir: str | Path | OutputStore, *, dest: str | Path | None = None,
                      png: bool = False) -> ReportFiles:
    """One job's page (a sharded job's: batchgen.jobs.commands.report), written by `save_report`."""
    store = open_store(out_dir)
    if not is_job_dir(store):
        raise OutputError(f"{store} is not a batchgen output directory (it has no _manifest)")
    return save_report(build_job_report(store), store, dest, png=png)


def save_report(report: Report, store: OutputStore, dest: str | Path | None, *, png: bool) -> ReportFiles:
    """To `dest` (a local directory), else the output's `_report/`: a local directory's, or the store's."""
    if dest is not None:
        return write_report(report, Path(dest), png=png)
    if isinstance(store, LocalStore):
        return write_report(report, store.path(REPORT_DIR), png=png)
    return upload_report(report, store, REPORT_DIR, png=png)


def job_metrics(store: OutputStore) -> tuple[pa.Table, pa.Table, Totals]:
    """(steps, rows, totals) from the job's `_metrics/`; empty for an object store, which keeps none."""
    if not isinstance(store, LocalStore):
        return SCHEMAS["steps"].empty_table(), SCHEMAS["rows"].empty_table(), Totals()
    directory = metrics_dir(store.path())
    return read_kind(directory, "steps"), read_kind(directory, "rows"), Totals.from_dir(directory)


def build_job_report(out_dir: Path | OutputStore) -> Report:
    store = open_store(out_dir)
    steps, rows, totals = job_metrics(store)
    state = load_manifest(store)
    holder = store.holder()  # the local lock's or the object store's lease holder
    summary = read_summary(store)
    t0 = min((t["time_s"][0].as_py() for t in (steps, rows) if t.num_rows), default=0)
    unit = time_unit(steps["time_s"][-1].as_py() + 1 - t0 if steps.num_rows else 0)
    vlines = _run_starts(steps, t0, unit)
    figs = [
        tokens_per_s_figure(steps, t0, vlines, unit),
        batch_and_kv_figure(steps, t0, vlines, unit),
        step_times_figure(steps),
        lengths_figure(rows),
        _rows_per_window(rows),
        _errors(store, state),
    ]
    if store.exists(SUCCESS_FILE):
        status = "complete"
    elif holder is not None:
        status = f"running (pid {holder.get('pid')} on {holder.get('host')})"
    else:
        status = "stopped before the end (killed or interrupted): the same `batchgen run` command resumes it"
    total_rows = sum(s["num_rows"] for s in state.inputs["inputs"]) if state.inputs else None
    facts = [("state", status),
             ("rows committed", f"{state.num_committed_rows} of {total_rows if total_rows is not None else '?'} "
                                f"({len(state.error_ids)} error rows)"),
             ("tokens generated (all runs)", f"{totals.num_generated_tokens:,}"),
             ("engine steps (all runs)", f"{totals.num_engine_steps:,} in {totals.engine_seconds:,.1f} s, "
                                         f"{totals.num_preemptions} preemptions"),
             ("runs", str(len(set(steps["run_id"].to_pylist())) if steps.num_rows else 0))]
    if steps.num_rows:
        span = steps["time_s"][-1].as_py() + 1 - t0
        facts.append(("wall time covered by metrics", f"{span:,} s, {totals.num_generated_tokens / span:,.1f} "
                                                      "tokens/s overall"))
    if summary:
        s = summary
        facts.append(("last finished run", f"{s.get('num_rows')} rows in {s.get('wall_seconds', 0):.1f} s, "
                                            f"{s.get('generated_tokens_per_s')} tok/s, mode {s.get('mode')}, "
                                            f"length MAE {s.get('length_mae')} tokens"))
        if s.get("num_shareable_prefix_tokens") or s.get("num_rows_from_duplicates"):
            hits, shareable = s.get("num_prefix_hit_prompt_tokens", 0), s.get("num_shareable_prefix_tokens", 0)
            facts.append(("shared prompts (last run)",
                          f"{hits:,} of {shareable:,} shareable prefix tokens from the prefix cache; "
                          f"{s.get('num_rows_from_duplicates', 0)} rows served from a duplicate prompt"))
    if state.last_commit_time:
        facts.append(("last commit", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.last_commit_time))))
    notes = ["Time axes count from the job's first metrics record; dotted lines mark a resumed run. Metrics are "
             "flushed every few seconds, so a killed job's last seconds may be missing."]
    if not isinstance(store, LocalStore):
        notes.append("An object-store output keeps no metrics files: the time series and histograms are empty.")
    return Report(title=f"batchgen job: {store.name}", subtitle=output_where(store), facts=facts, figures=figs,
                  notes=notes)


def output_where(store: OutputStore) -> str:
    return str(store.path().absolute()) if isinstance(store, LocalStore) else store.url


def read_summary(store: OutputStore) -> dict | None:
    try:
        summary = json.loads(store.read_bytes(SUMMARY_FILE))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def time_unit(span_s: float) -> tuple[float, str]:
    """(seconds per unit, name) for a time axis spanning `span_s`: seconds, minutes or hours."""
    if span_s <= 300:
        return 1.0, "seconds"
    if span_s <= 3 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _run_starts(steps: pa.Table, t0: int, unit: tuple[float, str]) -> list[tuple[float, str]]:
    out, seen = [], set()
    for run_id, t in zip(steps["run_id"].to_pylist(), steps["time_s"].to_pylist(), strict=True):
        if run_id not in seen:
            if seen:
                out.append(((t - t0) / unit[0], f"run {len(seen) + 1}"))
            seen.add(run_id)
    return out


def bins(times: list[int], t0: int) -> tuple[int, int]:
    """(bin width in seconds, number of bins) covering the records in at most MAX_POINTS bins."""
    span = times[-1] + 1 - t0
    width = max(1, math.ceil(span / MAX_POINTS))
    return width, math.ceil(span / width)


def tokens_per_s_figure(steps: pa.Table, t0: int, vlines, unit: tuple[float, str]) -> Figure:
    series: dict = {}
    if steps.num_rows:
        times = steps["time_s"].to_pylist()
        width, n = bins(times, t0)
        tokens = [0.0] * n
        for t, k in zip(times, steps["num_sampled_tokens"].to_pylist(), strict=True):
            tokens[(t - t0) // width] += k
        xs = [(i * width + width / 2) / unit[0] for i in range(n)]
        rate = [k / width for k in tokens]
        series[f"per {width} s"] = (xs, rate)
        w = max(1, 10 // width)
        smooth = [sum(rate[max(0, i - w + 1):i + 1]) / len(rate[max(0, i - w + 1):i + 1]) for i in range(n)]
        if w > 1 and n > 2 * w:  # a job of a few seconds has nothing to smooth
            series[f"mean over {w * width} s"] = (xs, smooth)
    png = figures.lines("Tokens generated per second", unit[1], "tokens/s", series, vlines=vlines)
    return Figure("tokens_per_s", "Throughput over time", "Tokens the engine sampled per second (in-flight rows "
                  "included). A dip is a mode switch, a commit, preemption or a busy machine; zero is a gap between "
                  "runs.", png)


def batch_and_kv_figure(steps: pa.Table, t0: int, vlines, unit: tuple[float, str]) -> Figure:
    left: dict = {}
    right: dict = {}
    if steps.num_rows:
        times = steps["time_s"].to_pylist()
        width, n = bins(times, t0)
        run_sum, step_count, kv = [0] * n, [0] * n, [math.nan] * n
        for t, rs, ns, used, total in zip(times, steps["num_running_sum"].to_pylist(), steps["num_steps"].to_pylist(),
                                         steps["num_kv_blocks_used_max"].to_pylist(),
                                         steps["num_kv_blocks_total"].to_pylist(), strict=True):
            i = (t - t0) // width
            run_sum[i] += rs
            step_count[i] += ns
            if total:
                kv[i] = max(100 * used / total, 0 if math.isnan(kv[i]) else kv[i])
        # a slow machine takes seconds per step, leaving most bins empty: plot the bins that hold
        # steps, joined, and break the line only where no step ran for GAP_S (between runs)
        xs: list[float] = []
        running: list[float] = []
        kv_used: list[float] = []
        last = None
        for i in (i for i in range(n) if step_count[i]):
            if last is not None and (i - last) * width > GAP_S:
                xs.append(math.nan)
                running.append(math.nan)
                kv_used.append(math.nan)
            xs.append((i * width + width / 2) / unit[0])
            running.append(run_sum[i] / step_count[i])
            kv_used.append(kv[i])
            last = i
        left["running sequences (mean)"] = (xs, running)
        right["KV cache used, % (max)"] = (xs, kv_used)
    png = figures.lines("Running sequences and KV cache use", unit[1], "sequences", left, right=right,
                        right_label="% of KV blocks", vlines=vlines)
    return Figure("batch_kv", "Batch occupancy and KV memory", "Solid: sequences in the batch per step, averaged "
                  "over each bin; dashed: the most KV blocks in use. A full cache with a small batch means memory-"
                  "bound (long rows); a small batch with free KV means starved of rows or limited by --batch-size.",
                  png)


def step_times_figure(steps: pa.Table) -> Figure:
    hist = LogHistogram()
    if steps.num_rows:
        for buckets, counts in zip(steps["step_hist_bucket"].to_pylist(), steps["step_hist_count"].to_pylist(),
                                   strict=True):
            for b, c in zip(buckets, counts, strict=True):
                hist.add_bucket(b, c)
    idx, counts = hist.nonzero()
    lows = [1000 * LogHistogram.bucket_low(i) for i in idx]
    highs = [1000 * LogHistogram.bucket_low(i + 1) for i in idx]
    marks = []
    if hist.count:
        marks = [(1000 * hist.quantile(0.5), f"p50 {1000 * hist.quantile(0.5):.1f} ms"),
                 (1000 * hist.quantile(0.99), f"p99 {1000 * hist.quantile(0.99):.1f} ms")]
    png = figures.log_histogram("Engine step time", "ms per step (log scale)", {"steps": (lows, highs, counts)},
                                marks=marks)
    return Figure("step_times", "Step-time histogram", "Every engine step of every run, in 1/16-octave buckets. "
                  "Two humps are usually decode steps and prefill (or chunked-prefill) steps; a long right tail is "
                  "preemption recomputes or a busy machine.", png)


def lengths_figure(rows: pa.Table) -> Figure:
    xs: list[int] = []
    ys: list[int] = []
    if rows.num_rows:
        for p, a in zip(rows["sample_predicted_tokens"].to_pylist(), rows["sample_actual_tokens"].to_pylist(),
                        strict=True):
            xs.extend(p)
            ys.extend(a)
    note = f"{len(xs)} sampled rows" if xs else ""
    png = figures.scatter("Predicted (p50) vs actual output length", "predicted tokens (p50)", "generated tokens",
                          xs, ys, note=note)
    return Figure("lengths", "Output length: predicted vs actual", "A uniform sample of up to 16 rows per second. "
                  "Points on the diagonal were predicted exactly; the planner orders rows and picks modes by these "
                  "predictions, so a cloud far from it means the static/continuous choice was a guess.", png)


def _rows_per_window(rows: pa.Table) -> Figure:
    per: dict[tuple[int | None, str], int] = Counter()
    if rows.num_rows:
        for window, mode, n, e in zip(rows["window"].to_pylist(), rows["mode"].to_pylist(),
                                      rows["num_rows"].to_pylist(), rows["num_rows_error"].to_pylist(), strict=True):
            if window is None:  # failed before planning: rejected requests, bad cells, prompts too long
                per[(None, REJECTED)] += e
            else:
                per[(window, mode or "?")] += n
    windows = sorted({s for s, _ in per}, key=lambda s: (s is None, s if s is not None else 0))
    modes = sorted({m for _, m in per})
    categories = ["none" if s is None else str(s) for s in windows]
    stacks = {m: [per.get((s, m), 0) for s in windows] for m in modes}
    png = figures.stacked_bars("Rows finished per window, by mode", "window", "rows", categories, stacks, counts=True)
    return Figure("rows_per_window", "Rows per mode per window", "Rows finished in each planned window, coloured by "
                  "the engine mode that ran them (a continuous window's rows in static mode are a static "
                  f"fallback). 'none': {REJECTED} (a request or row rejected: its endpoint, body, prompt, "
                  "length or constraint). Retried rows count again.", png)


def error_reasons(out_dir: Path | OutputStore, state) -> Counter:
    """Committed error rows by reason; numbers in a message become N so alike messages group."""
    store = open_store(out_dir)
    reasons: Counter = Counter()
    for record in list(state.parts.values()):
        if not record.error_ids:
            continue
        try:
            table = store.read_table(record.name, columns=["error"])
        except (OSError, pa.ArrowException):  # replaced or compacted since the manifest was read
            continue
        errors = table["error"].filter(pc.is_valid(table["error"]))
        for msg in errors.to_pylist():
            reasons[error_reason(msg)] += 1
    return reasons


def error_reason(message: str) -> str:
    """An error message as its reason: its numbers as N."""
    return NUMBER.sub("N", message)


def _errors(out_dir: Path | OutputStore, state) -> Figure:
    return errors_figure(error_reasons(out_dir, state))


def errors_figure(reasons: Counter) -> Figure:
    top = reasons.most_common(MAX_ERROR_REASONS)
    png = figures.horizontal_bars("Error rows by reason", "rows", [r for r, _ in top], [n for _, n in top],
                                  empty="no error rows committed", counts=True)
    return Figure("errors", "Error rows by reason", f"Committed error rows (finish_reason = error), the "
                  f"{MAX_ERROR_REASONS} most common messages, numbers shown as N. A resumed run retries them.", png)
