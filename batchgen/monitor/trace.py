"""Every step of one short benchmark run, for `batchgen bench --report`'s figures.

A benchmark's workload is fixed and small (hundreds of requests), so its steps are kept whole
(five numbers a step); a job, which may run for days, aggregates per second instead
(batchgen.monitor.recorder).
"""

from __future__ import annotations

import time

from batchgen.engine.metrics import StepStats


class StepTrace:
    __slots__ = ("started", "time_s", "num_sampled_tokens", "num_running", "kv_usage", "step_seconds")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.time_s: list[float] = []  # since the trace began, at the end of the step
        self.num_sampled_tokens: list[int] = []
        self.num_running: list[int] = []
        self.kv_usage: list[float] = []  # used / total KV blocks
        self.step_seconds: list[float] = []

    def __call__(self, s: StepStats) -> None:
        self.time_s.append(time.perf_counter() - self.started)
        self.num_sampled_tokens.append(s.num_sampled_tokens)
        self.num_running.append(s.num_running)
        total = s.num_kv_blocks_used + s.num_kv_blocks_free
        self.kv_usage.append(s.num_kv_blocks_used / total if total else 0.0)
        self.step_seconds.append(s.step_seconds)
