"""`batchgen bench --report DIR`: the policies of one comparison side by side, on one HTML page.

Tokens/s per policy (median and min over the rounds), then the last round of each policy over
time (throughput, batch occupancy, KV use) and their step-time histograms overlaid.
"""

from __future__ import annotations

import math
from pathlib import Path

from batchgen.engine.metrics import LogHistogram
from batchgen.monitor import figures
from batchgen.monitor.html import Figure, Report, ReportFiles, write_report
from batchgen.monitor.trace import StepTrace

NUM_BINS = 200


def _binned(trace: StepTrace, values: list[float], *, rate: bool, span_s: float) -> tuple[list[float], list[float]]:
    """(bin middles, per-bin sum / width when `rate`, else the per-bin mean)."""
    width = span_s / NUM_BINS or 1.0
    sums, counts = [0.0] * NUM_BINS, [0] * NUM_BINS
    for t, v in zip(trace.time_s, values, strict=True):
        i = min(NUM_BINS - 1, int(t / width))
        sums[i] += v
        counts[i] += 1
    xs = [(i + 0.5) * width for i in range(NUM_BINS)]
    if rate:
        return xs, [s / width for s in sums]
    return xs, [s / c if c else math.nan for s, c in zip(sums, counts, strict=True)]


def render_bench_report(result: dict, traces: dict[str, StepTrace], dest: str | Path, *, facts: list[tuple[str, str]],
                        png: bool = False) -> ReportFiles:
    span = max((t.time_s[-1] for t in traces.values() if t.time_s), default=1.0)
    tps, running, kv, hists = {}, {}, {}, {}
    for name, trace in traces.items():
        tps[name] = _binned(trace, trace.num_sampled_tokens, rate=True, span_s=span)
        running[name] = _binned(trace, trace.num_running, rate=False, span_s=span)
        kv[name] = _binned(trace, [100 * u for u in trace.kv_usage], rate=False, span_s=span)
        h = LogHistogram()
        for s in trace.step_seconds:
            h.add(s)
        idx, counts = h.nonzero()
        hists[name] = ([1000 * LogHistogram.bucket_low(i) for i in idx],
                       [1000 * LogHistogram.bucket_low(i + 1) for i in idx], counts)
    labels = [f"{name}: median of {len(r['runs'])}, min {r['tokens_per_s_min']:.0f}" for name, r in result.items()]
    figs = [
        Figure("bench_tokens_per_s", "Throughput by policy", "Generated tokens/s of the whole workload, median over "
               "the rounds (the policies ran round-robin, so a busy machine slowed each alike).",
               figures.horizontal_bars("Tokens/s by policy (median)", "tokens/s", labels,
                                       [round(r["tokens_per_s_median"], 1) for r in result.values()])),
        Figure("bench_over_time", "Throughput over time", "The last round of each policy: tokens sampled per second. "
               "Static batching's saw-tooth is each batch draining to its longest member.",
               figures.lines("Tokens/s over time", "seconds", "tokens/s", tps)),
        Figure("bench_running", "Batch occupancy", "Sequences in the batch, mean per bin.",
               figures.lines("Running sequences", "seconds", "sequences", running)),
        Figure("bench_kv", "KV cache use", "Share of KV blocks in use, mean per bin.",
               figures.lines("KV cache used (%)", "seconds", "% of blocks", kv)),
        Figure("bench_step_times", "Step times", "Every step of the last round of each policy.",
               figures.log_histogram("Engine step time", "ms per step (log scale)", hists)),
    ]
    report = Report(title="batchgen bench: " + " vs ".join(result), subtitle="continuous against static batching",
                    facts=facts, figures=figs)
    return write_report(report, Path(dest), png=png)
