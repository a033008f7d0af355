"""EngineMetrics in fixed memory: the summary's figures against exact ones computed from every step."""

from __future__ import annotations

import random
import statistics
import sys

from batchgen.engine.metrics import EngineMetrics, LogHistogram, StepStats


def random_steps(n: int, seed: int) -> list[StepStats]:
    rng = random.Random(seed)
    return [StepStats(step_seconds=rng.lognormvariate(-4, 0.8), num_running=rng.randrange(0, 64),
                      num_waiting=rng.randrange(0, 200), num_batched_tokens=rng.randrange(1, 2048),
                      num_sampled_tokens=rng.randrange(0, 64), num_kv_blocks_used=rng.randrange(0, 500),
                      num_kv_blocks_free=0, num_preempted=rng.randrange(0, 2), num_overruns=rng.randrange(0, 2),
                      forward_seconds=rng.random() * 0.01)
            for _ in range(n)]


def exact_quantile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, -(-int(q * len(s) * 1e9) // int(1e9)) - 1))]


def test_summary_matches_exact_figures_within_a_bucket():
    steps = random_steps(5000, 0)
    for s in steps:
        s.num_kv_blocks_free = 500 - s.num_kv_blocks_used
    metrics = EngineMetrics()
    for s in steps:
        metrics.record(s)
    summary = metrics.summary()
    secs = [s.step_seconds for s in steps]
    assert summary["num_steps"] == 5000
    assert summary["engine_seconds"] == round(sum(secs), 3)
    assert summary["forward_seconds"] == round(sum(s.forward_seconds for s in steps), 3)
    width = 2 ** (1 / LogHistogram.BUCKETS_PER_OCTAVE)  # one bucket: ~4.4%
    for key, q in (("step_ms_p50", 0.5), ("step_ms_p99", 0.99)):
        exact = 1000 * exact_quantile(secs, q)
        assert exact / width <= summary[key] <= exact * width, (key, exact, summary[key])
    assert abs(1000 * statistics.median(secs) - summary["step_ms_p50"]) / summary["step_ms_p50"] < 0.05
    assert summary["running_mean"] == round(statistics.fmean(s.num_running for s in steps), 1)
    assert summary["running_max"] == max(s.num_running for s in steps)
    assert summary["waiting_max"] == max(s.num_waiting for s in steps)
    assert summary["tokens_per_step_mean"] == round(statistics.fmean(s.num_batched_tokens for s in steps), 1)
    assert summary["tokens_per_step_max"] == max(s.num_batched_tokens for s in steps)
    assert summary["kv_blocks_used_max"] == max(s.num_kv_blocks_used for s in steps)
    assert summary["kv_blocks_total"] == 500
    assert summary["num_preemptions"] == sum(s.num_preempted for s in steps)
    assert summary["num_overruns"] == sum(s.num_overruns for s in steps)
    assert summary["num_sampled_tokens"] == sum(s.num_sampled_tokens for s in steps)


def test_memory_does_not_grow_with_steps():
    metrics = EngineMetrics()
    for s in random_steps(100, 1):
        metrics.record(s)
    size = sys.getsizeof(metrics.step_seconds_hist.counts)
    for s in random_steps(50_000, 2):
        metrics.record(s)
    assert sys.getsizeof(metrics.step_seconds_hist.counts) == size
    assert not any(isinstance(v, list) and len(v) > LogHistogram.NUM_BUCKETS
                   for v in (getattr(metrics, f) for f in metrics.__slots__))


def test_merged_equals_one_record_of_all_steps():
    a, b, both = EngineMetrics(), EngineMetrics(), EngineMetrics()
    steps = random_steps(3000, 3)
    for i, s in enumerate(steps):
        (a if i < 1000 else b).record(s)
        both.record(s)
    a.num_generated_tokens, b.num_generated_tokens, both.num_generated_tokens = 10, 20, 30
    assert EngineMetrics.merged([a, b]).summary() == both.summary()


def test_listeners_see_every_step():
    metrics = EngineMetrics()
    seen: list[StepStats] = []
    metrics.listeners.append(seen.append)
    steps = random_steps(10, 4)
    for s in steps:
        metrics.record(s)
    assert seen == steps


def test_histogram_buckets_cover_the_range():
    h = LogHistogram()
    for v in (0.0, 1e-9, 1e-6, 0.01, 1.0, 1e9):
        h.add(v)
    assert h.count == 6 and h.counts[0] == 3 and h.counts[-1] == 1
    assert h.quantile(0.0) is not None and h.quantile(1.0) == LogHistogram.bucket_mid(LogHistogram.NUM_BUCKETS - 1)
    for v in (3e-5, 0.02, 1.7):
        i = LogHistogram.bucket(v)
        assert LogHistogram.bucket_low(i) <= v < LogHistogram.bucket_low(i + 1)
