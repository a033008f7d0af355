"""What `<output>/_metrics/` holds: three kinds of records, each aggregated to one row per second.

- steps: the engine's iterations in that second (count, time, running/waiting sequences, batched
  and sampled tokens, KV blocks, preemptions, prefix-cache hits, a sparse step-time histogram),
  with the engine's mode and the newest planning window it was fed, and the job's ETA at that second.
- rows: rows finished in that second, per (window, mode), with up to SAMPLE_ROWS (predicted,
  actual) output lengths drawn uniformly from them (the report's scatter plot), and what they took
  from other rows: shareable prefix tokens, prefix-hit prompt tokens, rows served from a duplicate.
- commits: the commits of that second (rows, errors, tokens, time spent committing, rows in the
  output directory after them).

A million-step job therefore writes at most one steps row per second of wall time. Every row
carries `run_id` (the run that wrote it: a resumed job has several) and `time_s` (unix seconds).
The accumulators run between engine steps, so `add` is a handful of additions. The window column
was named "shard" in files written before: readers take either (batchgen.monitor.store.read_kind).
"""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa

from batchgen.engine.metrics import LogHistogram, StepStats

SAMPLE_ROWS = 16  # (predicted, actual) length pairs kept per rows record

STEPS_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("time_s", pa.int64()), ("mode", pa.string()), ("window", pa.int32()),
    ("num_steps", pa.int32()), ("step_seconds_sum", pa.float64()), ("step_seconds_max", pa.float64()),
    ("num_running_sum", pa.int64()), ("num_running_max", pa.int32()), ("num_waiting_max", pa.int32()),
    ("num_batched_tokens", pa.int64()), ("num_sampled_tokens", pa.int64()),
    ("num_kv_blocks_used", pa.int32()), ("num_kv_blocks_used_max", pa.int32()), ("num_kv_blocks_total", pa.int32()),
    ("num_preemptions", pa.int32()), ("num_prefix_hit_tokens", pa.int64()),
    ("step_hist_bucket", pa.list_(pa.int16())), ("step_hist_count", pa.list_(pa.int32())),
    ("eta_seconds", pa.float64()),
    ("num_prompt_tokens", pa.int64()),  # of num_batched_tokens, the prompts' (absent: null, in older files)
])

ROWS_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("time_s", pa.int64()), ("window", pa.int32()), ("mode", pa.string()),
    ("num_rows", pa.int32()), ("num_rows_error", pa.int32()), ("num_prompt_tokens", pa.int64()),
    ("num_generated_tokens", pa.int64()),
    ("sample_predicted_tokens", pa.list_(pa.int32())), ("sample_actual_tokens", pa.list_(pa.int32())),
    # of those rows: prompt tokens of full blocks another row of their look-ahead holds too, the prompt
    # tokens their first admission found in the prefix cache, and the rows --dedup wrote from another
    # row's run (absent: null, in older files)
    ("num_shareable_prefix_tokens", pa.int64()), ("num_prefix_hit_prompt_tokens", pa.int64()),
    ("num_rows_from_duplicates", pa.int32()),
])

COMMITS_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("time_s", pa.int64()), ("num_commits", pa.int32()), ("num_rows", pa.int32()),
    ("num_rows_error", pa.int32()), ("num_generated_tokens", pa.int64()), ("commit_seconds", pa.float64()),
    ("output_rows", pa.int64()), ("output_rows_error", pa.int64()), ("run_seconds", pa.float64()),
])

SCHEMAS = {"steps": STEPS_SCHEMA, "rows": ROWS_SCHEMA, "commits": COMMITS_SCHEMA}


class StepSecond:
    """The steps of one wall-clock second, as they arrive."""

    __slots__ = ("time_s", "mode", "window", "num_steps", "step_seconds_sum", "step_seconds_max", "num_running_sum",
                 "num_running_max", "num_waiting_max", "num_batched_tokens", "num_sampled_tokens",
                 "num_kv_blocks_used", "num_kv_blocks_used_max", "num_kv_blocks_total", "num_preemptions",
                 "num_prefix_hit_tokens", "num_prompt_tokens", "hist")

    def __init__(self, time_s: int, mode: str | None, window: int | None):
        self.time_s = time_s
        self.mode = mode
        self.window = window
        self.num_steps = 0
        self.step_seconds_sum = 0.0
        self.step_seconds_max = 0.0
        self.num_running_sum = 0
        self.num_running_max = 0
        self.num_waiting_max = 0
        self.num_batched_tokens = 0
        self.num_sampled_tokens = 0
        self.num_kv_blocks_used = 0
        self.num_kv_blocks_used_max = 0
        self.num_kv_blocks_total = 0
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_prompt_tokens = 0
        self.hist: dict[int, int] = {}  # step-time bucket (LogHistogram) -> steps

    def add(self, s: StepStats) -> None:
        self.num_steps += 1
        self.step_seconds_sum += s.step_seconds
        if s.step_seconds > self.step_seconds_max:
            self.step_seconds_max = s.step_seconds
        self.num_running_sum += s.num_running
        if s.num_running > self.num_running_max:
            self.num_running_max = s.num_running
        if s.num_waiting > self.num_waiting_max:
            self.num_waiting_max = s.num_waiting
        self.num_batched_tokens += s.num_batched_tokens
        self.num_sampled_tokens += s.num_sampled_tokens
        self.num_kv_blocks_used = s.num_kv_blocks_used
        if s.num_kv_blocks_used > self.num_kv_blocks_used_max:
            self.num_kv_blocks_used_max = s.num_kv_blocks_used
        self.num_kv_blocks_total = s.num_kv_blocks_used + s.num_kv_blocks_free
        self.num_preemptions += s.num_preempted
        self.num_prefix_hit_tokens += s.num_prefix_hit_tokens
        self.num_prompt_tokens += s.num_prompt_tokens
        bucket = LogHistogram.bucket(s.step_seconds)
        self.hist[bucket] = self.hist.get(bucket, 0) + 1

    def record(self, run_id: str, eta_seconds: float | None) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "hist"}
        buckets = sorted(self.hist)
        out.update(run_id=run_id, step_hist_bucket=buckets, step_hist_count=[self.hist[b] for b in buckets],
                   eta_seconds=eta_seconds)
        return out


class RowsSecond:
    """Rows of one (second, window, mode) that finished; a uniform sample of their lengths."""

    __slots__ = ("time_s", "window", "mode", "num_rows", "num_rows_error", "num_prompt_tokens",
                 "num_generated_tokens", "num_shareable_prefix_tokens", "num_prefix_hit_prompt_tokens",
                 "num_rows_from_duplicates", "samples")

    def __init__(self, time_s: int, window: int | None, mode: str | None):
        self.time_s = time_s
        self.window = window
        self.mode = mode
        self.num_rows = 0
        self.num_rows_error = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_shareable_prefix_tokens = 0
        self.num_prefix_hit_prompt_tokens = 0
        self.num_rows_from_duplicates = 0
        self.samples: list[tuple[int, int]] = []

    def add(self, *, num_prompt_tokens: int, num_generated_tokens: int, predicted_tokens: int | None,
            error: bool, rng: random.Random, num_shareable_prefix_tokens: int = 0,
            num_prefix_hit_prompt_tokens: int = 0, from_duplicate: bool = False) -> None:
        self.num_rows += 1
        self.num_rows_error += int(error)
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generated_tokens += num_generated_tokens
        self.num_shareable_prefix_tokens += num_shareable_prefix_tokens
        self.num_prefix_hit_prompt_tokens += num_prefix_hit_prompt_tokens
        self.num_rows_from_duplicates += int(from_duplicate)
        if error or predicted_tokens is None:
            return
        pair = (predicted_tokens, num_generated_tokens)
        num_seen = self.num_rows - self.num_rows_error
        if len(self.samples) < SAMPLE_ROWS:
            self.samples.append(pair)
        else:  # reservoir sampling over the row's second
            i = rng.randrange(num_seen)
            if i < SAMPLE_ROWS:
                self.samples[i] = pair

    def record(self, run_id: str) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "samples"}
        out.update(run_id=run_id, sample_predicted_tokens=[p for p, _ in self.samples],
                   sample_actual_tokens=[a for _, a in self.samples])
        return out


class CommitSecond:
    """The commits of one second."""

    __slots__ = ("time_s", "num_commits", "num_rows", "num_rows_error", "num_generated_tokens", "commit_seconds",
                 "output_rows", "output_rows_error", "run_seconds")

    def __init__(self, time_s: int):
        self.time_s = time_s
        self.num_commits = 0
        self.num_rows = 0
        self.num_rows_error = 0
        self.num_generated_tokens = 0
        self.commit_seconds = 0.0
        self.output_rows = 0
        self.output_rows_error = 0
        self.run_seconds = 0.0

    def record(self, run_id: str) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["run_id"] = run_id
        return out
