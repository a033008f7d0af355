"""The work a run has done and has left, in prompt (input) and generated (output) tokens, and the ETA.

A prefill-heavy job spends most of its time on prompts: counting generated tokens alone leaves
its progress at zero for minutes and its ETA in the hours. So the meter counts both kinds of
work from every engine step, measures what a token of each costs, and prices the planner's
prediction of what is left:

    ETA = prompt tokens left x seconds per prompt token + output tokens left x seconds per output token

A step's prompt tokens are its batched tokens at prompt positions (StepStats.num_prompt_tokens); its
output tokens are the tokens it sampled, each the work of one sequence in the batch. Prompt tokens
found in the prefix cache are done without being computed. An output token costs what the
decode-only steps took per token they sampled; a prompt token, what the steps with prompt tokens
took per prompt token once their output tokens are paid at that price. Until a decode-only step has
run (a prefill-heavy job's first minutes), both are priced at the pooled cost, step time over all
tokens: a fit of step time on both counts would be asked to price a handful of output tokens riding
along with thousands of prompt tokens, and it turns the steps' noise into output tokens that cost
twenty times a prompt token. Older steps weigh less (a batch shrinks at a job's tail, which changes
what a token costs). A step's time is the wall time since the previous step ended, not the engine's
step alone: the job's own work between steps (finished rows, commits, admitting requests) is time
the rest of the job will spend too.

The rates shown beside it (tokens/s) are over the last RATE_WINDOW_S seconds of steps.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchgen.engine.metrics import StepStats

RATE_WINDOW_S = 60  # tokens/s are taken over the last minute of steps
COST_HALF_LIFE_S = 120.0  # a step this long ago weighs half in the cost fit


@dataclass(frozen=True, slots=True)
class PredictedWork:
    """The whole run's predicted work: its rows' prompt tokens and their predicted output tokens."""

    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class WorkEstimate:
    num_prompt_tokens_done: int  # computed or found in the prefix cache, this run
    num_output_tokens_done: int  # sampled this run, rows in flight included
    input_tokens_per_s: float | None
    output_tokens_per_s: float | None
    eta_s: float | None  # None before the first step or without a prediction
    fraction_done: float | None = None  # of the predicted work, priced at the measured costs


class WorkMeter:
    """Fed every engine step (a listener, on the job's thread); read by the progress display and
    the metrics (their own threads)."""

    def __init__(self, predicted: Callable[[], PredictedWork | None], *,
                 clock: Callable[[], float] = time.monotonic, rate_window_s: float = RATE_WINDOW_S,
                 cost_half_life_s: float = COST_HALF_LIFE_S):
        self.predicted = predicted
        self.clock = clock
        self.rate_window_s = rate_window_s
        self.cost_half_life_s = cost_half_life_s
        self.num_prompt_tokens_done = 0
        self.num_output_tokens_done = 0
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque()  # (end, prompt, output)
        self._first_step_start: float | None = None
        self._last_step_end: float | None = None
        # decayed sums: steps with prompt tokens (seconds, prompt, output), decode-only steps (seconds, output)
        self._sums = [0.0] * 5
        self._first_step: tuple[float, int, int] | None = None  # (seconds, prompt, output)

    def on_step(self, stats: StepStats) -> None:
        end = self.clock()
        prompt, output = stats.num_prompt_tokens, stats.num_sampled_tokens
        with self._lock:
            seconds = stats.step_seconds if self._last_step_end is None else max(
                end - self._last_step_end, stats.step_seconds)
            if self._first_step_start is None:
                self._first_step_start = end - seconds
            if self._last_step_end is not None and end > self._last_step_end:
                decay = 0.5 ** ((end - self._last_step_end) / self.cost_half_life_s)
                self._sums = [s * decay for s in self._sums]
            self._last_step_end = end
            if self._first_step is None:
                self._first_step = (seconds, prompt, output)  # kept apart: see costs()
                sums = [0.0] * 5
            else:
                sums = self._sums
            if prompt:
                sums[0] += seconds
                sums[1] += prompt
                sums[2] += output
            else:
                sums[3] += seconds
                sums[4] += output
            self.num_prompt_tokens_done += prompt + stats.num_prefix_hit_tokens
            self.num_output_tokens_done += output
            self._recent.append((end, prompt, output))

    def costs(self) -> tuple[float, float] | None:
        """(seconds per prompt token, seconds per output token); None before any step with tokens."""
        with self._lock:
            prefill_s, prompt, prefill_output, decode_s, decode_output = self._sums
            first = self._first_step
        tokens = prompt + prefill_output + decode_output
        if tokens <= 0:
            # an engine's first step carries one-time work (kernels chosen and built, memory first
            # touched): it prices the work only until a second step has run
            if first is None or first[1] + first[2] <= 0:
                return None
            pooled = first[0] / (first[1] + first[2])
            return pooled, pooled
        pooled = (prefill_s + decode_s) / tokens
        output_cost = decode_s / decode_output if decode_output > 0 else pooled
        if prompt <= 0:
            return pooled, output_cost
        prompt_cost = (prefill_s - output_cost * prefill_output) / prompt
        if prompt_cost <= 0:  # decode-only steps cost more per token than the mixed ones: pool those
            prompt_cost = prefill_s / (prompt + prefill_output)
        return prompt_cost, output_cost

    def rates(self, now: float) -> tuple[float | None, float | None]:
        """(prompt, output) tokens/s over the last rate window of steps."""
        with self._lock:
            recent = self._recent
            while recent and recent[0][0] <= now - self.rate_window_s:
                recent.popleft()
            if self._first_step_start is None:
                return None, None
            span = now - max(self._first_step_start, now - self.rate_window_s)
            if span <= 0:
                return None, None
            return sum(r[1] for r in recent) / span, sum(r[2] for r in recent) / span

    def estimate(self) -> WorkEstimate:
        now = self.clock()
        input_rate, output_rate = self.rates(now)
        prompt_done, output_done = self.num_prompt_tokens_done, self.num_output_tokens_done
        predicted, costs = self.predicted(), self.costs()
        eta = fraction = None
        if predicted is not None and costs is not None:
            prompt_cost, output_cost = costs
            left = (max(predicted.num_prompt_tokens - prompt_done, 0) * prompt_cost
                    + max(predicted.num_output_tokens - output_done, 0) * output_cost)
            done = min(prompt_done, predicted.num_prompt_tokens) * prompt_cost + min(
                output_done, predicted.num_output_tokens) * output_cost
            eta = left
            fraction = done / (done + left) if done + left > 0 else 1.0
        return WorkEstimate(prompt_done, output_done, input_rate, output_rate, eta, fraction)
