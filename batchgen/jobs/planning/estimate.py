"""What `batchgen plan` estimates: time from a short calibration run, KV memory per window, and
job-wide length quantiles in bounded memory.

Estimated time comes from a few engine steps over a sample of the first window's prompts (a
handful of generated tokens each, then one row alone), fitted as

    step seconds = overhead + seconds_per_token x tokens in the step

and applied to each window's predicted work: continuous runs its prompt tokens in chunks of the step
budget and its output tokens batch_size at a time; static runs each predicted batch until its
longest member (p90) finishes. Rows --dedup serves from a copy run nothing, and with --prefix-order
a row's shared prefix tokens are computed once, by its group's leader. The calibration runs the
continuous policy; whatever the static policy saves per step beyond that is not in the estimate.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.engine.engine import LLMEngine
from batchgen.engine.kv.groups import KVGroups
from batchgen.engine.metrics import StepStats
from batchgen.engine.request import Request, SamplingParams
from batchgen.jobs.planning.planner import WindowPlan, batch_slices
from batchgen.jobs.planning.stats import Reservoir, ceil_div, distribution
from batchgen.jobs.rows.planned_row import PlannedRow

CALIBRATION_NEW_TOKENS = 8
CALIBRATION_MAX_PROMPT_TOKENS = 1024  # longer sample prompts are cut: a calibration, not a job
SAMPLE_SIZE = 10_000  # values kept for the job-wide quantiles


@dataclass(frozen=True, slots=True)
class Calibration:
    num_rows: int
    num_steps: int
    step_overhead_s: float
    seconds_per_token: float

    def seconds(self, num_steps: float, num_tokens: float) -> float:
        return num_steps * self.step_overhead_s + num_tokens * self.seconds_per_token


def calibrate(engine: LLMEngine, prompts: list[list[int]]) -> Calibration:
    """Time a few engine steps: the sample together, then its first row alone (small steps)."""
    sample = [p[:CALIBRATION_MAX_PROMPT_TOKENS] for p in prompts]
    runs = [[sample[0][:4]], sample, sample[:1]]
    points: list[tuple[int, float]] = []
    for run, batch in enumerate(runs):
        steps: list[StepStats] = []
        engine.metrics.listeners.append(steps.append)
        for i, prompt_ids in enumerate(batch):
            engine.add_request(Request(f"calibrate-{run}-{i}", prompt_ids, SamplingParams(
                max_new_tokens=CALIBRATION_NEW_TOKENS, ignore_eos=True)))
        try:
            while engine.has_unfinished():
                engine.step()
        finally:
            engine.metrics.listeners.remove(steps.append)
        if run:  # the first run only warms the engine up
            points += [(s.num_batched_tokens, s.step_seconds) for s in steps]
    overhead, per_token = _fit_line(points)
    return Calibration(len(prompts), len(points), overhead, per_token)


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares y = a + b x, kept physical (a, b >= 0): a flat line when y does not grow with
    x, a line through 0 when the intercept comes out negative."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    vx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / vx if vx else 0.0
    if b <= 0:
        return my, 0.0
    a = my - b * mx
    if a < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return a, b


@dataclass(slots=True)
class WindowWork:
    """What a window's time estimate needs, kept instead of its rows."""

    num_rows: int
    num_sequences: int  # a row runs one per sample
    prompt_tokens: int
    output_tokens: int  # sum of p50 over the samples
    static_steps: int  # sum over predicted static batches of prefill chunks + the longest p90
    shared_tokens: int = 0  # prompt tokens of rows that run that another row computes (prefix groups)
    num_copies: int = 0  # rows --dedup serves from another row's run (their prompt and output not run)


class Tally:
    """Count, total and max of a stream, with a bounded uniform sample for its quantiles."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.count = self.total = 0
        self.max = None
        self.sample = Reservoir(SAMPLE_SIZE)

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        self.max = value if self.max is None else max(self.max, value)
        self.sample.add(value, self.rng)

    def describe(self) -> dict[str, Any]:
        d = distribution(self.sample.values)
        d.update(count=self.count, total=self.total, max=self.max,
                 mean=round(self.total / self.count, 1) if self.count else None)
        return d


def window_work(plan: WindowPlan, budget: int, is_copy: Callable[[PlannedRow], bool] = lambda r: False,
                prefix_order: bool = False) -> WindowWork:
    """The window's work. `is_copy`: rows --dedup serves without running them. With `prefix_order`, a
    row's shared prefix tokens are computed by its group's leader alone (planning/prefix_groups.py);
    without it the estimate computes every prompt token (what the cache gives by chance is not in it)."""
    def computed(r: PlannedRow) -> int:
        return r.num_prompt_tokens - (r.num_shared_prefix_tokens if prefix_order else 0)

    static_steps = 0
    for batch in batch_slices(plan.rows, plan.static_batches):
        run = [r for r in batch if not is_copy(r)] or batch[:1]
        static_steps += ceil_div(sum(computed(r) for r in run), budget)
        static_steps += max(r.prediction.p90 for r in run)
    rows = [r for r in plan.rows if not is_copy(r)]
    return WindowWork(len(rows), sum(r.num_samples for r in rows), sum(computed(r) for r in rows),
                      sum(r.prediction.p50 * r.num_samples for r in rows), static_steps,
                      sum(r.num_shared_prefix_tokens for r in rows), plan.num_rows - len(rows))


def kv_bytes(plan: WindowPlan, batch_size: int, block_size: int, bytes_per_token: int,
             kv_window: int | None = None, budget: int | None = None,
             kv_groups: KVGroups | None = None) -> dict[str, int]:
    """KV memory the window needs at its peak: the largest static batch's reservations (prompt + p90,
    whole blocks), or for continuous the batch_size longest rows at prompt + p50. With `kv_window`
    (every layer's sliding window, whose out-of-window blocks the engine returns) a continuous row
    holds at most its window plus one step's chunk of `budget` tokens; static reservations are
    taken whole at admission, so they count every token. With `kv_groups` (a local/global model,
    engine/kv/groups.py; `bytes_per_token` is then one pool block's) a row holds a block per block
    of its tokens in every group, but in a sliding group at most its window's, reserved or not.
    A row with n samples runs n sequences: the first holds the prompt, each other only the prompt's
    last, partial block (the full ones are shared) and its own output."""
    def blocks(r: PlannedRow, num_tokens: int) -> int:
        if kv_groups is not None:
            return kv_groups.blocks_held(num_tokens, budget or r.num_prompt_tokens, block_size)
        return ceil_div(num_tokens, block_size)

    def held_blocks(r: PlannedRow, num_tokens: int) -> int:
        if kv_window is None:
            return blocks(r, num_tokens)
        return min(blocks(r, num_tokens), ceil_div(kv_window + (budget or r.num_prompt_tokens), block_size) + 1)

    def sequences(r: PlannedRow, out: int, count: Callable[[PlannedRow, int], int]) -> list[int]:
        other = count(r, r.num_prompt_tokens % block_size + out)
        return [count(r, r.num_prompt_tokens + out)] + [other] * (r.num_samples - 1)

    static = 0
    for batch in batch_slices(plan.rows, plan.static_batches):
        static = max(static, sum(sum(sequences(r, r.prediction.p90, blocks)) for r in batch))
    longest = sorted((b for r in plan.rows for b in sequences(r, r.prediction.p50, held_blocks)),
                     reverse=True)[:batch_size]
    per_block = block_size * bytes_per_token
    result = {"static": static * per_block, "continuous": sum(longest) * per_block}
    result["needed"] = result[plan.mode]
    return result


def window_seconds(calibration: Calibration, work: WindowWork, batch_size: int, budget: int) -> dict[str, float]:
    """The window's estimated seconds in each mode."""
    continuous_steps = ceil_div(work.prompt_tokens, budget) + ceil_div(work.output_tokens,
                                                                       min(batch_size, work.num_sequences))
    tokens = work.prompt_tokens + work.output_tokens
    return {"static": round(calibration.seconds(work.static_steps, tokens), 3),
            "continuous": round(calibration.seconds(continuous_steps, tokens), 3)}
