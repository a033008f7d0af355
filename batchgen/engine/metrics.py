"""Iteration-level counters in fixed memory: running sums, maxima and a log-bucket histogram of
step times, summarized at the end of a run.

An engine that runs for days takes millions of steps, so no step is kept: `record` folds each
StepStats into sums and one fixed histogram (about 400 integers), and hands it to the listeners
(the job's metrics recorder streams per-second aggregates to disk; `batchgen plan`'s calibration
collects a few points). The median and p99 step times come from the histogram: buckets are 1/16
of an octave wide, so a quantile is within about 2% of the exact one. Metrics of several engines
(a mode switch builds a new one) merge exactly: sums add, maxima take the larger, histograms add.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepStats:
    step_seconds: float
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    num_sampled_tokens: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_preempted: int
    num_overruns: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens this step found in the prefix cache
    forward_seconds: float = 0.0  # the model call's share of step_seconds (ModelRunner.last_forward_s)
    num_prompt_tokens: int = 0  # of num_batched_tokens, those at prompt positions (prefill, not decode)


class LogHistogram:
    """Counts of positive values in log-spaced buckets: bucket i holds [lo * 2^(i/16), lo * 2^((i+1)/16)).

    The range 1 µs .. ~1e5 s (in seconds) covers any step; values outside go to the end buckets.
    """

    BUCKETS_PER_OCTAVE = 16
    LOWEST = 1e-6
    NUM_BUCKETS = 37 * BUCKETS_PER_OCTAVE  # 2^37 µs ~ 1.4e5 s

    __slots__ = ("counts", "count")

    def __init__(self) -> None:
        self.counts = [0] * self.NUM_BUCKETS
        self.count = 0

    @classmethod
    def bucket(cls, value: float) -> int:
        if value <= cls.LOWEST:
            return 0
        return min(cls.NUM_BUCKETS - 1, int(math.log2(value / cls.LOWEST) * cls.BUCKETS_PER_OCTAVE))

    @classmethod
    def bucket_mid(cls, index: int) -> float:
        """The bucket's geometric middle: the value a quantile in it is reported as."""
        return cls.LOWEST * 2 ** ((index + 0.5) / cls.BUCKETS_PER_OCTAVE)

    @classmethod
    def bucket_low(cls, index: int) -> float:
        return cls.LOWEST * 2 ** (index / cls.BUCKETS_PER_OCTAVE)

    def add(self, value: float, n: int = 1) -> None:
        self.counts[self.bucket(value)] += n
        self.count += n

    def add_bucket(self, index: int, n: int) -> None:
        self.counts[index] += n
        self.count += n

    def merge(self, other: LogHistogram) -> None:
        for i, n in enumerate(other.counts):
            if n:
                self.counts[i] += n
        self.count += other.count

    def quantile(self, q: float) -> float | None:
        """The nearest-rank q-quantile, as its bucket's middle; None when empty."""
        if not self.count:
            return None
        rank = min(self.count, max(1, math.ceil(q * self.count)))
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return self.bucket_mid(i)
        raise AssertionError("histogram counts do not add up to its count")

    def nonzero(self) -> tuple[list[int], list[int]]:
        """(bucket indices, counts) of the buckets that hold anything: the sparse form stored on disk."""
        idx = [i for i, n in enumerate(self.counts) if n]
        return idx, [self.counts[i] for i in idx]


@dataclass(slots=True)
class EngineMetrics:
    num_steps: int = 0
    engine_seconds: float = 0.0
    forward_seconds: float = 0.0  # the model calls alone; the rest of a step is host work around them
    step_seconds_hist: LogHistogram = field(default_factory=LogHistogram)
    sum_running: int = 0  # summed over steps: the mean is sum / num_steps
    running_max: int = 0
    waiting_max: int = 0
    sum_batched_tokens: int = 0
    batched_tokens_max: int = 0
    kv_blocks_used_max: int = 0
    kv_blocks_total: int = 0  # used + free at the latest step
    num_preemptions: int = 0
    num_overruns: int = 0
    num_prefix_hit_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    # every step's new tokens, so in flight too (num_generated_tokens counts finished requests)
    num_sampled_tokens: int = 0
    # jump-forward (engine/sampling/jump_forward.py): tokens the grammar forced and the model's picks
    # confirmed, each a decode step its row did not take
    num_forced_tokens: int = 0
    num_row_steps: int = 0  # steps x rows that gained tokens in them: what generating cost in decode steps
    num_oom_retries: int = 0  # steps run again after a device OOM, on a smaller cache and batch
    # called with every StepStats after it is counted; they must be cheap (they run between two steps)
    listeners: list[Callable[[StepStats], None]] = field(default_factory=list)

    def record(self, stats: StepStats) -> None:
        self.num_steps += 1
        self.engine_seconds += stats.step_seconds
        self.forward_seconds += stats.forward_seconds
        self.step_seconds_hist.add(stats.step_seconds)
        self.sum_running += stats.num_running
        self.running_max = max(self.running_max, stats.num_running)
        self.waiting_max = max(self.waiting_max, stats.num_waiting)
        self.sum_batched_tokens += stats.num_batched_tokens
        self.batched_tokens_max = max(self.batched_tokens_max, stats.num_batched_tokens)
        self.kv_blocks_used_max = max(self.kv_blocks_used_max, stats.num_kv_blocks_used)
        self.kv_blocks_total = stats.num_kv_blocks_used + stats.num_kv_blocks_free
        self.num_preemptions += stats.num_preempted
        self.num_overruns += stats.num_overruns
        self.num_sampled_tokens += stats.num_sampled_tokens
        for listener in self.listeners:
            listener(stats)

    @classmethod
    def merged(cls, parts: list[EngineMetrics]) -> EngineMetrics:
        """One record of several engines' metrics (in the order they ran: the last one's KV size wins)."""
        out = cls()
        for m in parts:
            out.num_steps += m.num_steps
            out.engine_seconds += m.engine_seconds
            out.forward_seconds += m.forward_seconds
            out.step_seconds_hist.merge(m.step_seconds_hist)
            out.sum_running += m.sum_running
            out.running_max = max(out.running_max, m.running_max)
            out.waiting_max = max(out.waiting_max, m.waiting_max)
            out.sum_batched_tokens += m.sum_batched_tokens
            out.batched_tokens_max = max(out.batched_tokens_max, m.batched_tokens_max)
            out.kv_blocks_used_max = max(out.kv_blocks_used_max, m.kv_blocks_used_max)
            out.kv_blocks_total = m.kv_blocks_total or out.kv_blocks_total
            for name in ("num_preemptions", "num_overruns", "num_prefix_hit_tokens", "num_prompt_tokens",
                         "num_generated_tokens", "num_requests_finished", "num_sampled_tokens", "num_forced_tokens",
                         "num_row_steps", "num_oom_retries"):
                setattr(out, name, getattr(out, name) + getattr(m, name))
        return out

    def summary(self) -> dict:
        n = self.num_steps
        if not n:
            return {"num_steps": 0}
        total = self.engine_seconds
        return {
            "num_steps": n,
            "engine_seconds": round(total, 3),
            "forward_seconds": round(self.forward_seconds, 3),
            "step_ms_mean": round(1000 * total / n, 2),
            "step_ms_p50": round(1000 * self.step_seconds_hist.quantile(0.5), 2),
            "step_ms_p99": round(1000 * self.step_seconds_hist.quantile(0.99), 2),
            "running_mean": round(self.sum_running / n, 1),
            "running_max": self.running_max,
            "waiting_max": self.waiting_max,
            "tokens_per_step_mean": round(self.sum_batched_tokens / n, 1),
            "tokens_per_step_max": self.batched_tokens_max,
            "kv_blocks_used_max": self.kv_blocks_used_max,
            "kv_blocks_total": self.kv_blocks_total,
            "num_preemptions": self.num_preemptions,
            "num_overruns": self.num_overruns,
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_requests_finished": self.num_requests_finished,
            "num_sampled_tokens": self.num_sampled_tokens,
            "num_forced_tokens": self.num_forced_tokens,
            "num_row_steps": self.num_row_steps,
            "num_oom_retries": self.num_oom_retries,
            "generated_tokens_per_s": round(self.num_generated_tokens / total, 2) if total else None,
        }
