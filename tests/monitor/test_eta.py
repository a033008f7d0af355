"""WorkMeter: prompt and output work priced at measured costs, on a fake clock (no timing)."""

from __future__ import annotations

import pytest

from batchgen.engine.metrics import StepStats
from batchgen.monitor.eta import PredictedWork, WorkMeter

PROMPT_COST_S = 0.001  # the simulated engine's seconds per prompt token
OUTPUT_COST_S = 0.02  # and per output token (a decode token costs more: a step's fixed work)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def stats(prompt: int, output: int, seconds: float, prefix_hits: int = 0) -> StepStats:
    return StepStats(step_seconds=seconds, num_running=4, num_waiting=0, num_batched_tokens=prompt + output,
                     num_sampled_tokens=output, num_kv_blocks_used=1, num_kv_blocks_free=1, num_preempted=0,
                     num_prefix_hit_tokens=prefix_hits, num_prompt_tokens=prompt)


def prefill_heavy_steps(num_rows: int, prompt_len: int, output_len: int, budget: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per step of a chunked-prefill schedule: prompts in chunks of
    `budget` tokens; a row samples its first token as its prompt ends, then one a step with the rest."""
    steps, decoding = [], []  # decoding: tokens left per row
    prompt_left = [prompt_len] * num_rows
    row = 0
    while row < num_rows or decoding:
        output = len(decoding)
        decoding = [n - 1 for n in decoding if n > 1]
        prompt = 0
        while row < num_rows and prompt < budget:
            chunk = min(budget - prompt, prompt_left[row])
            prompt += chunk
            prompt_left[row] -= chunk
            if prompt_left[row] == 0:
                output += 1
                if output_len > 1:
                    decoding.append(output_len - 1)
                row += 1
        steps.append((prompt, output))
    return steps


def test_eta_prices_predicted_prompt_and_output_tokens_at_their_measured_costs():
    """40 rows of 2000 prompt tokens and 4 output tokens: prefill is 90% of the time. The ETA is
    within 2x of the true time left from the first step to the last 1% of the job, and exact once a
    decode-only step has measured what an output token costs."""
    num_rows, prompt_len, output_len = 40, 2000, 4
    steps = prefill_heavy_steps(num_rows, prompt_len, output_len, budget=2048)
    durations = [p * PROMPT_COST_S + d * OUTPUT_COST_S for p, d in steps]
    total_s = sum(durations)
    clock = Clock()
    meter = WorkMeter(lambda: PredictedWork(num_rows * prompt_len, num_rows * output_len), clock=clock)
    assert meter.estimate().eta_s is None  # before the first step: unknown, not hours
    elapsed, decode_only_seen = 0.0, False
    for i, ((p, d), seconds) in enumerate(zip(steps, durations, strict=True)):
        clock.t += seconds
        elapsed += seconds
        meter.on_step(stats(p, d, seconds))
        est = meter.estimate()
        left = total_s - elapsed
        assert est.eta_s is not None
        if left >= 0.01 * total_s:  # the last 1%: a few output tokens, priced before a decode-only step
            assert left / 2 <= est.eta_s <= 2 * left, (i, est.eta_s, left)
        if decode_only_seen:  # both costs measured
            assert est.eta_s == pytest.approx(left, abs=1e-6), i
        decode_only_seen = decode_only_seen or p == 0
    est = meter.estimate()
    assert est.num_prompt_tokens_done == num_rows * prompt_len
    assert est.num_output_tokens_done == num_rows * output_len
    assert est.eta_s == pytest.approx(0.0, abs=1e-9) and est.fraction_done == pytest.approx(1.0)
    assert meter.costs() == (pytest.approx(PROMPT_COST_S), pytest.approx(OUTPUT_COST_S))


def test_rates_count_prompt_tokens_while_only_prefill_runs():
    clock = Clock()
    meter = WorkMeter(lambda: PredictedWork(10_000, 10), clock=clock)
    for _ in range(5):
        clock.t += 1.0
        meter.on_step(stats(1000, 0, 1.0))
    est = meter.estimate()
    assert est.input_tokens_per_s == pytest.approx(1000.0)
    assert est.output_tokens_per_s == 0.0
    # prefill only: one pooled cost (1 ms a token) for what is left of both kinds
    assert est.eta_s == pytest.approx(5000 * 0.001 + 10 * 0.001)
    assert est.fraction_done == pytest.approx(5000 / 10_010)


def test_rates_are_over_the_last_window():
    clock = Clock()
    meter = WorkMeter(lambda: None, clock=clock, rate_window_s=10)
    clock.t += 1.0
    meter.on_step(stats(5000, 0, 1.0))  # a burst of prefill, then decode only for 20 s
    for _ in range(20):
        clock.t += 1.0
        meter.on_step(stats(0, 8, 1.0))
    est = meter.estimate()
    assert est.input_tokens_per_s == 0.0 and est.output_tokens_per_s == pytest.approx(8.0)
    assert est.eta_s is None  # no prediction (no row planned yet): no ETA


def test_prefix_cache_hits_count_as_prompt_work_done():
    clock = Clock()
    meter = WorkMeter(lambda: PredictedWork(2000, 0), clock=clock)
    clock.t += 1.0
    meter.on_step(stats(1000, 0, 1.0, prefix_hits=1000))
    assert meter.estimate().eta_s == pytest.approx(0.0)


def test_a_few_output_tokens_riding_with_prefill_are_not_priced_by_the_steps_noise():
    """Chunked prefill: steps of 2048 prompt tokens carry 10 to 40 output tokens, and their times
    vary by a few percent with the machine, by chance in step with those counts. A fit of time on
    both counts would price an output token at 50 ms, 40x a prompt token, and put 7000 predicted
    output tokens at 350 s; the pooled price (the only one the steps can tell) keeps it near."""
    clock = Clock()
    meter = WorkMeter(lambda: PredictedWork(40 * 2048, 7000), clock=clock)
    for i in range(20):
        output = 10 + (i * 7) % 31
        seconds = 2.5 + 0.05 * (output - 25)
        clock.t += seconds
        meter.on_step(stats(2048, output, seconds))
    prompt_cost, output_cost = meter.costs()
    assert output_cost == pytest.approx(prompt_cost) and output_cost < 0.0013
    est = meter.estimate()
    true_left = 20 * 2.5 + 7000 * 0.0012  # if output tokens cost what prompt tokens do
    assert true_left / 2 <= est.eta_s <= 2 * true_left, est.eta_s


def test_decode_only_steps_price_output_tokens_and_the_rest_is_the_prompts():
    clock = Clock()
    meter = WorkMeter(lambda: PredictedWork(10_000, 1000), clock=clock, cost_half_life_s=1e12)  # no decay
    # the first step only warms up (test_the_first_step_prices_the_work_only_until_a_second_has_run)
    for prompt, output, seconds in ((1000, 4, 1.04), (1000, 4, 1.04), (0, 8, 0.08), (0, 8, 0.08)):
        clock.t += seconds
        meter.on_step(stats(prompt, output, seconds))
    assert meter.costs() == (pytest.approx(0.001), pytest.approx(0.01))


def test_the_first_step_prices_the_work_only_until_a_second_has_run():
    """An engine's first step carries one-time work (kernels built, memory first touched)."""
    clock = Clock()
    meter = WorkMeter(lambda: PredictedWork(10_000, 0), clock=clock)
    clock.t += 10.0
    meter.on_step(stats(1000, 0, 10.0))  # 10 ms a token, once
    assert meter.estimate().eta_s == pytest.approx(9000 * 0.01)
    clock.t += 1.0
    meter.on_step(stats(1000, 0, 1.0))  # 1 ms a token, from now on
    assert meter.estimate().eta_s == pytest.approx(8000 * 0.001)
