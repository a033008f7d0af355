"""`batchgen plan`: the dry run. Tokenize, plan, calibrate, estimate; write nothing.

It reads the input as `batchgen run` would (same checks, same prompts), plans every shard with
batchgen.jobs.plan (with --output naming a job's directory, only the rows a resume would run: the
committed ones are counted, not planned), and reports per shard the rows, prompt and predicted
output lengths, the mode with its reason, the KV memory needed and an estimated time. Memory stays
bounded like the job's: one window of rows at a time, per-shard aggregates, and bounded samples for
the job-wide quantiles.

Estimated time comes from a short calibration run: a few engine steps over a sample of the first
shard's prompts (a handful of generated tokens each, then one row alone), fitted as

    step seconds = overhead + seconds_per_token x tokens in the step

and applied to each shard's predicted work: continuous runs its prompt tokens in chunks of the step
budget and its output tokens batch_size at a time; static runs each predicted batch until its
longest member (p90) finishes. The calibration runs the continuous policy; whatever the static
policy saves per step beyond that is not in the estimate. Without a sample (no rows, or
--calibration-rows 0) there is no estimate.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.config import JobConfig
from batchgen.engine.engine import LLMEngine
from batchgen.engine.loader import LoadedModel, load_model
from batchgen.engine.request import Request, SamplingParams
from batchgen.io.manifest import is_job_dir, load_manifest
from batchgen.jobs.length import LengthPredictor
from batchgen.jobs.plan import STATIC, PlannedRow, Planner, ShardPlan, distribution, prepare_row
from batchgen.jobs.prompts import PromptBuilder, RowError
from batchgen.jobs.resume import scan_inputs
from batchgen.jobs.rows import RowSource
from batchgen.jobs.run import build_engine, length_model_key

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
        first = len(engine.metrics.steps)
        for i, prompt_ids in enumerate(batch):
            engine.add_request(Request(f"calibrate-{run}-{i}", prompt_ids, SamplingParams(
                max_new_tokens=CALIBRATION_NEW_TOKENS, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
        if run:  # the first run only warms the engine up
            points += [(s.num_batched_tokens, s.step_seconds) for s in engine.metrics.steps[first:]]
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
class _ShardWork:
    """What a shard's time estimate needs, kept instead of its rows."""

    num_rows: int
    prompt_tokens: int
    output_tokens: int  # sum of p50
    static_steps: int  # sum over predicted static batches of prefill chunks + the longest p90


class _Tally:
    """Count, total and max of a stream, with a bounded uniform sample for its quantiles."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.count = self.total = 0
        self.max = None
        self.sample: list[int] = []

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        self.max = value if self.max is None else max(self.max, value)
        if len(self.sample) < SAMPLE_SIZE:
            self.sample.append(value)
        else:
            i = self.rng.randrange(self.count)
            if i < SAMPLE_SIZE:
                self.sample[i] = value

    def describe(self) -> dict[str, Any]:
        d = distribution(self.sample)
        d.update(count=self.count, total=self.total, max=self.max,
                 mean=round(self.total / self.count, 1) if self.count else None)
        return d


def plan_job(config: JobConfig, *, loaded: LoadedModel | None = None, calibration_rows: int = 16) -> dict[str, Any]:
    """The plan as JSON-ready data; raises BatchgenError subclasses for user mistakes."""
    config.validate(need_output=False)
    source = RowSource.open(config)
    scan = scan_inputs(source)
    if loaded is None:
        loaded = load_model(config.model, device=config.device, dtype=config.dtype,
                            trust_remote_code=config.trust_remote_code, quantize=config.quantize,
                            quantize_backend=config.quantize_backend)
    engine = build_engine(config, loaded)
    builder = PromptBuilder(loaded.tokenizer, source.template, system=config.system, chat=config.chat,
                            max_context_tokens=engine.max_tokens_per_seq, on_long_prompt=config.on_long_prompt,
                            max_prompt_tokens=config.max_prompt_tokens)
    out_dir = Path(config.output) if config.output and Path(config.output).is_dir() else None
    predictor = LengthPredictor.load(out_dir, length_model_key(loaded, builder), ignore_eos=config.ignore_eos)
    # a resume runs neither the committed rows nor, without --retry-errors, the committed error rows
    state = load_manifest(out_dir) if out_dir is not None and is_job_dir(out_dir) else None
    done_ids = set() if state is None else state.ok_ids | (set() if config.retry_errors else set(state.error_ids))
    block_size = engine.block_size
    planner = Planner(config, predictor, kv_capacity_tokens=engine.kv_cache.num_blocks * block_size,
                      block_size=block_size)
    bytes_per_token = engine.kv_cache.spec.bytes_per_token
    num_errors = num_done = 0

    def rows():
        nonlocal num_errors, num_done
        for row in source:
            if row.row_id in done_ids:
                num_done += 1
                continue
            try:
                if row.error is not None:
                    raise RowError(row.error)
                planned = prepare_row(row, builder, config)
            except RowError:
                num_errors += 1
                continue
            yield planned

    rng = random.Random(0)
    prompt_tally, p50_tally, p90_tally = _Tally(rng), _Tally(rng), _Tally(rng)
    shards: list[dict[str, Any]] = []
    work: list[_ShardWork] = []
    sample: list[list[int]] = []
    for plan in planner.plans(rows()):
        if not sample and calibration_rows > 0:
            step = max(1, plan.num_rows // calibration_rows)  # spread over the shard, not its longest rows
            sample = [r.prompt_token_ids for r in plan.rows[::step][:calibration_rows]]
        for r in plan.rows:
            prompt_tally.add(r.num_prompt_tokens)
            p50_tally.add(r.prediction.p50)
            p90_tally.add(r.prediction.p90)
        entry = plan.describe()
        entry["kv_bytes"] = _kv_bytes(plan, config.batch_size, block_size, bytes_per_token)
        shards.append(entry)
        work.append(_shard_work(plan, config.max_num_batched_tokens))

    calibration = calibrate(engine, sample) if sample else None
    total_s = 0.0 if calibration else None
    for entry, w in zip(shards, work, strict=True):
        if calibration is None:
            entry["estimated_seconds"] = None
            entry["estimates"] = None
            continue
        continuous_steps = (math.ceil(w.prompt_tokens / config.max_num_batched_tokens)
                            + math.ceil(w.output_tokens / min(config.batch_size, w.num_rows)))
        tokens = w.prompt_tokens + w.output_tokens
        estimates = {"static": round(calibration.seconds(w.static_steps, tokens), 3),
                     "continuous": round(calibration.seconds(continuous_steps, tokens), 3)}
        entry["estimates"] = estimates
        entry["estimated_seconds"] = estimates[entry["mode"]]
        total_s += estimates[entry["mode"]]
    del engine

    return {
        "inputs": scan.to_json(), "model": loaded.name, "mode": config.mode, "window_rows": config.window_rows,
        "batch_size": config.batch_size, "static_min_occupancy": config.static_min_occupancy,
        "num_rows": prompt_tally.count, "num_error_rows": num_errors, "num_rows_done": num_done,
        "num_shards": len(shards),
        "num_shards_static": sum(s["mode"] == STATIC for s in shards),
        "prompt_tokens": prompt_tally.describe(), "predicted_output_tokens": p50_tally.total,
        "output_tokens_p50": p50_tally.describe(), "output_tokens_p90": p90_tally.describe(),
        "learned_rows": predictor.num_learned_rows,
        "kv": {"bytes_per_token": bytes_per_token, "cache_bytes": planner.kv_capacity_tokens * bytes_per_token,
               "cache_tokens": planner.kv_capacity_tokens,
               "needed_bytes_max": max((s["kv_bytes"]["needed"] for s in shards), default=0)},
        "calibration": None if calibration is None else {
            "num_rows": calibration.num_rows, "num_steps": calibration.num_steps,
            "step_overhead_ms": round(1000 * calibration.step_overhead_s, 3),
            "ms_per_token": round(1000 * calibration.seconds_per_token, 5)},
        "estimated_seconds": None if total_s is None else round(total_s, 3),
        "shards": shards,
    }


def _shard_work(plan: ShardPlan, budget: int) -> _ShardWork:
    static_steps = 0
    start = 0
    for size in plan.static_batches:
        batch = plan.rows[start:start + size]
        static_steps += math.ceil(sum(r.num_prompt_tokens for r in batch) / budget)
        static_steps += max(r.prediction.p90 for r in batch)
        start += size
    return _ShardWork(plan.num_rows, sum(r.num_prompt_tokens for r in plan.rows),
                      sum(r.prediction.p50 for r in plan.rows), static_steps)


def _kv_bytes(plan: ShardPlan, batch_size: int, block_size: int, bytes_per_token: int) -> dict[str, int]:
    """KV memory the shard needs at its peak: the largest static batch's reservations (prompt + p90,
    whole blocks), or for continuous the batch_size longest rows at prompt + p50."""
    def blocks(r: PlannedRow, out: int) -> int:
        return -(-(r.num_prompt_tokens + out) // block_size)

    static = 0
    start = 0
    for size in plan.static_batches:
        static = max(static, sum(blocks(r, r.prediction.p90) for r in plan.rows[start:start + size]))
        start += size
    longest = sorted((blocks(r, r.prediction.p50) for r in plan.rows), reverse=True)[:batch_size]
    per_block = block_size * bytes_per_token
    result = {"static": static * per_block, "continuous": sum(longest) * per_block}
    result["needed"] = result[plan.mode]
    return result


def plan_lines(report: dict[str, Any]) -> list[str]:
    """The plan for people: a header, then one line per shard."""
    p, o50, o90, kv = report["prompt_tokens"], report["output_tokens_p50"], report["output_tokens_p90"], report["kv"]
    done = f"; {report['num_rows_done']} committed before, not planned" if report["num_rows_done"] else ""
    lines = [
        f"plan: {report['num_rows']} rows ({report['num_error_rows']} error rows{done}) in {report['num_shards']} "
        f"shards of at most {report['window_rows']} rows; mode {report['mode']}: {report['num_shards_static']} "
        f"static, {report['num_shards'] - report['num_shards_static']} continuous",
        f"prompt tokens: mean {p['mean']}, p50 {p['p50']}, p90 {p['p90']}, max {p['max']}, total {p['total']}",
        f"predicted output tokens per row: p50 mean {o50['mean']} (p50 {o50['p50']}, p90 {o50['p90']}, max "
        f"{o50['max']}); p90 mean {o90['mean']}; total {report['predicted_output_tokens']}; learned from "
        f"{report['learned_rows']} earlier rows",
        f"KV cache: {_size(kv['bytes_per_token'])} per token; the engine's cache holds {kv['cache_tokens']} tokens "
        f"({_size(kv['cache_bytes'])}); the most a shard needs at once: {_size(kv['needed_bytes_max'])}",
    ]
    cal = report["calibration"]
    if cal is None:
        lines.append("estimated time: none (no calibration run)")
    else:
        lines.append(f"calibration: {cal['num_steps']} steps on {cal['num_rows']} rows: a step costs "
                     f"{cal['step_overhead_ms']} ms + {cal['ms_per_token']} ms per token; estimated time "
                     f"{report['estimated_seconds']:.1f} s")
    lines.append(f"{'shard':>5} {'rows':>7} {'mode':<10} {'est s':>9} {'occupancy':>9}  source (first row): reason")
    for s in report["shards"]:
        est = "-" if s["estimated_seconds"] is None else f"{s['estimated_seconds']:.1f}"
        lines.append(f"{s['index']:>5} {s['num_rows']:>7} {s['mode']:<10} {est:>9} {s['static_occupancy']:>9.0%}  "
                     f"{Path(s['path']).name} ({s['first_row']}): {s['reason']}")
    return lines


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes} B"
