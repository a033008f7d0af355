"""Iteration-level counters: one record per engine step, summarized at the end of a run."""

from __future__ import annotations

import statistics
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


@dataclass(slots=True)
class EngineMetrics:
    steps: list[StepStats] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    num_sampled_tokens: int = 0  # every step's, so in flight too (num_generated_tokens counts finished requests)
    keep_steps: int = 100_000  # bound memory on endless jobs: keep the latest steps only

    def record(self, stats: StepStats) -> None:
        self.steps.append(stats)
        self.num_sampled_tokens += stats.num_sampled_tokens
        if len(self.steps) > 2 * self.keep_steps:
            del self.steps[: len(self.steps) - self.keep_steps]

    def summary(self) -> dict:
        steps = self.steps
        if not steps:
            return {"num_steps": 0}
        secs = sorted(s.step_seconds for s in steps)
        total = sum(secs)
        return {
            "num_steps": len(steps),
            "engine_seconds": round(total, 3),
            "step_ms_mean": round(1000 * total / len(steps), 2),
            "step_ms_p50": round(1000 * statistics.median(secs), 2),
            "step_ms_p99": round(1000 * secs[min(len(secs) - 1, int(0.99 * len(secs)))], 2),
            "running_mean": round(statistics.fmean(s.num_running for s in steps), 1),
            "running_max": max(s.num_running for s in steps),
            "waiting_max": max(s.num_waiting for s in steps),
            "tokens_per_step_mean": round(statistics.fmean(s.num_batched_tokens for s in steps), 1),
            "kv_blocks_used_max": max(s.num_kv_blocks_used for s in steps),
            "kv_blocks_total": steps[-1].num_kv_blocks_used + steps[-1].num_kv_blocks_free,
            "num_preemptions": sum(s.num_preempted for s in steps),
            "num_overruns": sum(s.num_overruns for s in steps),
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_requests_finished": self.num_requests_finished,
            "generated_tokens_per_s": round(self.num_generated_tokens / total, 2) if total else None,
        }
