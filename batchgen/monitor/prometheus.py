"""The job's figures for Prometheus: a collector over MetricsRecorder, a textfile, an HTTP endpoint.

One registry with one collector serves both ways out: node-exporter's textfile collector
(`--metrics-textfile`, rewritten atomically by prometheus_client's `write_to_textfile` after
every flush) and a scrape endpoint (`--metrics-port`, prometheus_client's own HTTP server,
bound to localhost unless `--metrics-host` says otherwise). Names follow Prometheus'
conventions: a `batchgen_` prefix, base units in the name, `_total` on counters only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchgen.errors import ConfigError
from batchgen.monitor.recorder import MetricsRecorder

log = logging.getLogger("batchgen")

# counter name (without _total) -> (Totals field, help)
COUNTERS = {
    "batchgen_tokens_generated": ("num_generated_tokens", "Tokens sampled by the engine, over every run of the job."),
    "batchgen_engine_steps": ("num_engine_steps", "Engine iterations (forward steps)."),
    "batchgen_engine_busy_seconds": ("engine_seconds", "Seconds spent inside engine steps."),
    "batchgen_preemptions": ("num_preemptions", "Sequences preempted for lack of KV blocks (recomputed later)."),
    "batchgen_prefix_cache_hit_tokens": ("num_prefix_hit_tokens", "Prompt tokens found in the prefix cache."),
    "batchgen_shareable_prefix_tokens": ("num_shareable_prefix_tokens",
                                         "Prompt tokens of the rows run that another row's prompt prefix holds "
                                         "too (full blocks): what a perfect prefix cache saves."),
    "batchgen_prefix_hit_prompt_tokens": ("num_prefix_hit_prompt_tokens",
                                          "Prompt tokens of the rows run that their first admission found in the "
                                          "prefix cache (the summary's figure, against the shareable tokens)."),
    "batchgen_rows_from_duplicates": ("num_rows_from_duplicates",
                                      "Rows written from another row's run: the same prompt and settings (--dedup)."),
    "batchgen_rows_finished": ("num_rows", "Rows finished, error rows included (a retried row counts again)."),
    "batchgen_rows_failed": ("num_rows_error", "Rows finished as error rows."),
    "batchgen_commits": ("num_commits", "Commits of finished rows to the output directory."),
}


class JobCollector(Collector):
    def __init__(self, recorder: MetricsRecorder):
        self.recorder = recorder

    def collect(self) -> Iterator[Metric]:
        snap = self.recorder.snapshot()
        for name, (attr, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(snap.totals, attr))
        gauges = {
            "batchgen_input_rows": (snap.input_rows, "Rows in the job's input (of --max-rows, if given)."),
            "batchgen_output_rows": (snap.output_rows, "Rows committed in the output directory, error rows included."),
            "batchgen_output_error_rows": (snap.output_rows_error, "Error rows committed in the output directory."),
            "batchgen_generated_tokens_per_second": (snap.tokens_per_s, "Tokens sampled per second, last minute."),
            "batchgen_prompt_tokens_per_second": (snap.input_tokens_per_s,
                                                  "Prompt tokens computed (prefilled) per second, last minute."),
            "batchgen_eta_seconds": (snap.eta_seconds, "Estimated seconds until the run ends: predicted prompt "
                                                       "and output tokens left at their measured costs."),
            "batchgen_running_sequences": (snap.num_running, "Sequences in the engine's batch at the latest step."),
            "batchgen_waiting_sequences": (snap.num_waiting, "Sequences queued in the engine at the latest step."),
            "batchgen_kv_cache_blocks_used": (snap.num_kv_blocks_used, "KV cache blocks in use at the latest step."),
            "batchgen_kv_cache_blocks": (snap.num_kv_blocks_total, "KV cache blocks allocated."),
            "batchgen_kv_cache_usage_ratio": (
                snap.num_kv_blocks_used / snap.num_kv_blocks_total if snap.num_kv_blocks_total else None,
                "Share of the KV cache in use at the latest step (0-1)."),
            "batchgen_last_commit_timestamp_seconds": (snap.last_commit_s, "Unix time of the latest commit."),
            "batchgen_run_start_timestamp_seconds": (snap.run_started_s, "Unix time this run started."),
        }
        for name, (value, doc) in gauges.items():
            if value is not None:  # absent rather than a made-up 0 (no step yet, no commit yet)
                yield GaugeMetricFamily(name, doc, value=value)


class PrometheusExport:
    """The registry, the textfile it rewrites after each flush, and the HTTP server, if asked for."""

    def __init__(self, recorder: MetricsRecorder, *, textfile: str | None, port: int | None, host: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(recorder))
        self.textfile = Path(textfile) if textfile else None
        if self.textfile is not None:
            if not self.textfile.parent.is_dir():
                raise ConfigError(f"--metrics-textfile: directory {self.textfile.parent} does not exist")
            recorder.exporters.append(self.write_textfile)
        self.server = None
        self.port = None
        if port is not None:
            try:
                self.server, _ = start_http_server(port, addr=host, registry=self.registry)
            except OSError as e:
                raise ConfigError(f"--metrics-port: cannot listen on {host}:{port}: {e.strerror or e}") from None
            self.port = self.server.server_port
            log.info("metrics: http://%s:%d/metrics", host, self.port)

    def write_textfile(self) -> None:
        # write_to_textfile writes a temp file beside it and renames it over: node-exporter never
        # reads half a file
        write_to_textfile(str(self.textfile), self.registry)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
