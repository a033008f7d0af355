"""Length-aware planning: input rows -> windows, each with predicted lengths, a run order and a mode.

Windows. A window is at most `window_rows` consecutive rows of one input file (never called a shard:
that is the --num-shards partition, docs/architecture.md). Only one window is held at a time (its
rows' columns and prompt token ids) and no sort reaches past it, so a file of any size is planned in
bounded memory. A window is planned when the engine asks for its first row, so it is predicted with what
the rows before it taught.

Order. Rows run by predicted output length, longest first (`sort_by_length`), in either mode.
Static: each batch then holds rows of alike length, since a batch runs until its longest member
finishes while the finished members' slots idle. Continuous: a slot is refilled the step it frees,
but the window still ends with its last rows running in a draining batch, and longest-first
(LPT scheduling) leaves the short rows for that tail, so the window ends in fewer steps
(benchmarks/end_to_end/planner.py compares sorted and unsorted runs).

Mode (`--mode auto`). The planner cuts the window, in run order, into the batches the static policy
would take (batch_size rows, fewer where the KV cache holds fewer) and predicts how busy their
slots would be:

    occupancy = sum(p50) / sum over batches of (rows in the batch x the batch's largest p90)

Static when occupancy >= static_min_occupancy, else continuous. Not the spread of the window's
lengths: prompt lengths never idle a static slot (each prompt is prefilled once, in chunks, in
either mode), and a wide but predictable spread, once sorted, gives batches of alike rows. The p90
in the denominator counts uncertainty against static: with nothing learned (p50 = max/2,
p90 = max) occupancy is 0.5. Static pays off where occupancy x (static / continuous tokens/s on
uniform lengths) >= 1; benchmarks/end_to_end/planner.py measures that ratio and prints the threshold it implies.
The default 1.0 says that static pays only where its batches leave no slot idle: a static step
costs what a continuous one does. That is no accident of the CPU: our static
policy runs the same steps through the same runner as continuous, with no per-step saving to trade
for idle slots. A device where static steps run cheaper (a captured or compiled fixed-shape step)
would lower the threshold; `--static-min-occupancy` sets it.

Prompt-heavy windows go continuous even at full occupancy: when a static batch's prompts need more
than one step's token budget to prefill, the static batch decodes nothing until the last of them
is in, while continuous decodes the rows already prefilled inside those same steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.config.choices import Policy
from batchgen.config.constraint import Constraint
from batchgen.config.job import OPENAI_BATCH, JobConfig
from batchgen.engine.scheduler.sizing import BatchLimits, resolve_limits
from batchgen.jobs.openai.requests import prepare_request_row
from batchgen.jobs.planning.length import LengthPredictor, parse_known_length
from batchgen.jobs.planning.prefix_groups import PrefixGrouper, assign_leaders
from batchgen.jobs.planning.stats import ceil_div, distribution
from batchgen.jobs.prompting.chat_rows import conversation_token_ids
from batchgen.jobs.prompting.prompts import PromptBuilder, row_max_new_tokens
from batchgen.jobs.rows.planned_row import PlannedRow, num_samples, row_settings_key
from batchgen.jobs.rows.row_adapter import adapter_identity, row_adapter
from batchgen.jobs.rows.row_constraint import check_compiles, row_constraint
from batchgen.jobs.rows.row_sampling import row_sampling
from batchgen.jobs.rows.rows import InputRow


def prepare_row(row: InputRow, builder: PromptBuilder, config: JobConfig, *,
                compile_constraint: Callable[[Constraint], Any] | None = None) -> PlannedRow:
    """Prompt ids, budget and known length of one row; raises RowError for an error row.
    `compile_constraint` (the engine's GrammarMasks.compiled): the row's own constraint is compiled
    against the model's tokenizer here, so that one that does not compile is this row's error."""
    planned = _prepare_row(row, builder, config)
    planned.num_samples = num_samples(config, planned)
    if compile_constraint is not None:
        check_compiles(planned, config, compile_constraint)
    return planned


def _prepare_row(row: InputRow, builder: PromptBuilder, config: JobConfig) -> PlannedRow:
    if config.input_format == OPENAI_BATCH:
        return prepare_request_row(row, builder, config)
    max_new = row_max_new_tokens(row.values, config.max_new_tokens_column, config.max_new_tokens)
    known = parse_known_length(row.values.get(config.length_column), config.length_column) \
        if config.length_column else None
    sampling = row_sampling(row.values, config.sampling_column)
    constraint = row_constraint(row, config)
    adapter = row_adapter(row, config)
    key = row_settings_key(config, max_new, sampling, constraint, adapter_identity(adapter, config))
    if row.messages is not None:  # a chat dataset's conversation (batchgen.jobs.prompting.chat_rows)
        ids = conversation_token_ids(row.messages, builder, column=config.prompt_column, system=config.system,
                                     max_new_tokens=max_new)
        return PlannedRow(row, ids, max_new, 0, known, sampling=sampling, constraint=constraint, settings_key=key,
                          adapter=adapter)
    prompt = builder.build(row.values, max_new)
    return PlannedRow(row, prompt.token_ids, max_new, prompt.num_truncated_tokens, known, sampling=sampling,
                      constraint=constraint, settings_key=key, adapter=adapter)


@dataclass(slots=True)
class WindowPlan:
    index: int
    path: str
    first_row_index: int  # the window's first row within its file
    rows: list[PlannedRow]  # in run order
    mode: Policy
    reason: str
    static_occupancy: float
    total_cv: float  # coefficient of variation of predicted prompt + output tokens (shown, not decisive)
    static_batches: list[int] = field(default_factory=list)  # rows per predicted static batch
    batch_size: int = 0  # sequences at once: the user's --batch-size or the auto choice for this window
    batch_size_reason: str = ""

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def describe(self) -> dict[str, Any]:
        """The window as `batchgen plan --json` shows it (without per-row data)."""
        p50 = [r.prediction.p50 for r in self.rows]  # of each sample: a row's samples are drawn alike
        sources: dict[str, int] = {}
        for r in self.rows:
            sources[r.prediction.source] = sources.get(r.prediction.source, 0) + 1
        return {
            "index": self.index, "path": self.path, "first_row": self.first_row_index, "num_rows": self.num_rows,
            "mode": self.mode, "reason": self.reason, "static_occupancy": round(self.static_occupancy, 4),
            "total_cv": round(self.total_cv, 4), "num_static_batches": len(self.static_batches),
            "batch_size": self.batch_size, "batch_size_reason": self.batch_size_reason,
            "prompt_tokens": distribution([r.num_prompt_tokens for r in self.rows]),
            "num_sequences": sum(r.num_samples for r in self.rows),
            "predicted_output_tokens": sum(r.prediction.p50 * r.num_samples for r in self.rows),
            "output_tokens_p50": distribution(p50),
            "output_tokens_p90": distribution([r.prediction.p90 for r in self.rows]),
            "prediction_sources": sources,
        }


class Planner:
    """Windows of prepared rows -> WindowPlans (predictions, run order, mode and reason)."""

    def __init__(self, config: JobConfig, predictor: LengthPredictor, *, kv_capacity_tokens: int | None = None,
                 block_size: int = 16, device_type: str = "cpu", max_model_len: int = 1 << 20):
        self.config = config
        self.device_type = device_type
        self.max_model_len = max_model_len
        self.predictor = predictor
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.num_windows = 0
        self.num_planned_rows = 0
        self.num_predicted_tokens = 0  # sum of p50 over the planned rows' samples
        self.num_planned_prompt_tokens = 0  # once per row: a row's samples share its prompt's prefill
        # rows sharing a prompt prefix (planning/prefix_groups.py); with --no-prefix-order it only counts them
        self.grouper = PrefixGrouper(config.window_rows, block_size, reorder=config.prefix_order)
        self._lookahead_leaders: dict[int, PlannedRow] = {}

    @property
    def num_shareable_prefix_tokens(self) -> int:
        """Prompt tokens of the rows planned so far that a perfect prefix cache would not compute."""
        return self.grouper.num_shareable_tokens

    def plans(self, rows: Iterable[PlannedRow]) -> Iterator[WindowPlan]:
        for window in self.grouper.windows(rows):
            yield self.plan(window)

    def plan(self, window: list[PlannedRow]) -> WindowPlan:
        config = self.config
        for r in window:
            r.prediction = self.predictor.predict(r.num_prompt_tokens, r.max_new_tokens, r.known_output_tokens)
            r.window_index = self.num_windows
            self.num_predicted_tokens += r.prediction.p50 * r.num_samples
            self.num_planned_prompt_tokens += r.num_prompt_tokens
        self.num_planned_rows += len(window)
        ordered = sort_by_length(window) if config.sort_by_length else list(window)
        if config.prefix_order:
            assign_leaders(ordered, self._lookahead_leaders, self.block_size)
        limits = self.batch_limits(window)
        batches = static_batches(ordered, limits.max_num_seqs, self.kv_capacity_tokens, self.block_size)
        occupancy = static_occupancy(ordered, batches)
        cv = coefficient_of_variation([r.num_prompt_tokens + r.prediction.p50 for r in window])
        prefill_steps = max_prefill_steps(ordered, batches, limits.max_num_batched_tokens)
        mode, reason = choose_mode(config.mode, occupancy, config.static_min_occupancy, window, prefill_steps)
        plan = WindowPlan(self.num_windows, window[0].row.file.path, window[0].row.row_index, ordered, mode, reason,
                         occupancy, cv, batches, limits.max_num_seqs, limits.reason)
        self.num_windows += 1
        return plan

    def batch_limits(self, window: list[PlannedRow]) -> BatchLimits:
        """--batch-size, or auto: what the KV cache holds of this window's sequences (prompt + predicted
        output, mean; a row's samples share its prompt), within the device's cap (engine/scheduler/sizing.py)."""
        expected = (sum(reserved_tokens(r, r.prediction.p50, 1) for r in window)
                    // max(1, sum(r.num_samples for r in window)))
        return resolve_limits(device_type=self.device_type, kv_capacity_tokens=self.kv_capacity_tokens or 1 << 40,
                              max_num_seqs=self.config.batch_size,
                              max_num_batched_tokens=self.config.max_num_batched_tokens,
                              expected_seq_tokens=max(1, expected), max_model_len=self.max_model_len)


def windows(rows: Iterable[PlannedRow], window_rows: int) -> Iterator[list[PlannedRow]]:
    """Consecutive rows of one file, at most window_rows of them; a new file starts a new window."""
    window: list[PlannedRow] = []
    for r in rows:
        if window and (len(window) >= window_rows or r.row.file.path != window[0].row.file.path):
            yield window
            window = []
        window.append(r)
    if window:
        yield window


def sort_by_length(rows: list[PlannedRow]) -> list[PlannedRow]:
    """Longest predicted output first (then longest p90, then longest prompt); stable otherwise. A
    prefix group (planning/prefix_groups.py) stays together, placed by its longest row, and runs
    longest first within."""
    def own(r: PlannedRow) -> tuple[int, int, int]:
        return r.prediction.p50, r.prediction.p90, r.num_prompt_tokens

    longest: dict[int, tuple[int, int, int]] = {}
    for r in rows:
        if r.prefix_group is not None:
            longest[r.prefix_group] = max(longest.get(r.prefix_group, own(r)), own(r))
    return sorted(rows, key=lambda r: (own(r), 0, own(r)) if r.prefix_group is None
                  else (longest[r.prefix_group], r.prefix_group + 1, own(r)), reverse=True)


def static_batches(rows: list[PlannedRow], batch_size: int, kv_capacity_tokens: int | None,
                   block_size: int) -> list[int]:
    """Rows per batch as the static policy would take them in this order: batch_size sequences (a
    row runs one per sample), fewer where their prompt + p90 reservations outgrow the KV cache."""
    sizes: list[int] = []
    num_rows = num_seqs = used = 0
    for r in rows:
        need = reserved_tokens(r, r.prediction.p90, block_size)
        if num_rows and (num_seqs + r.num_samples > batch_size
                         or (kv_capacity_tokens is not None and used + need > kv_capacity_tokens)):
            sizes.append(num_rows)
            num_rows = num_seqs = used = 0
        num_rows += 1
        num_seqs += r.num_samples
        used += need
    if num_rows:
        sizes.append(num_rows)
    return sizes


def reserved_tokens(r: PlannedRow, num_output_tokens: int, block_size: int) -> int:
    """KV slots a row's sequences hold at num_output_tokens each, in whole blocks: the first sample
    its prompt and output, less the blocks its prefix leader holds (planning/prefix_groups.py);
    each other sample the prompt's last, partial block (shared are only the full ones,
    engine/scheduler/samples.py) and its own output."""
    shared = r.num_leader_prefix_tokens if r.prefix_leader is not None else 0
    first = ceil_div(r.num_prompt_tokens + num_output_tokens, block_size) - shared // block_size
    partial = r.num_prompt_tokens % block_size
    other = ceil_div(partial + num_output_tokens, block_size)
    return (first + (r.num_samples - 1) * other) * block_size


def batch_slices(rows: list[PlannedRow], batch_sizes: list[int]) -> Iterator[list[PlannedRow]]:
    """The rows of each predicted static batch, in run order (`batch_sizes` from static_batches)."""
    start = 0
    for size in batch_sizes:
        yield rows[start:start + size]
        start += size


def static_occupancy(rows: list[PlannedRow], batch_sizes: list[int]) -> float:
    """Predicted fraction of static batch slots doing useful work (see the module docstring)."""
    useful = slots = 0
    for batch in batch_slices(rows, batch_sizes):
        useful += sum(r.prediction.p50 * r.num_samples for r in batch)
        slots += sum(r.num_samples for r in batch) * max(r.prediction.p90 for r in batch)
    return useful / slots if slots else 1.0


def coefficient_of_variation(values: list[int]) -> float:
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else 0.0


def max_prefill_steps(rows: list[PlannedRow], batch_sizes: list[int], max_num_batched_tokens: int) -> int:
    """The most steps any predicted static batch needs to prefill its prompts (>= 1)."""
    most = 1
    for batch in batch_slices(rows, batch_sizes):
        most = max(most, ceil_div(sum(r.num_prompt_tokens for r in batch), max(1, max_num_batched_tokens)))
    return most


def choose_mode(requested: str, occupancy: float, threshold: float, rows: list[PlannedRow],
                prefill_steps: int = 1) -> tuple[Policy, str]:
    if requested in (Policy.STATIC, Policy.CONTINUOUS):
        return Policy(requested), f"--mode {requested}"
    sources = {r.prediction.source for r in rows}
    basis = "exact lengths" if sources == {"exact"} else "predicted lengths (" + ", ".join(sorted(sources)) + ")"
    if occupancy >= threshold and prefill_steps > 1:
        # a static batch decodes nothing until its last prompt is in; continuous decodes the rows
        # already prefilled in those same steps (see the module docstring)
        return Policy.CONTINUOUS, (f"prompt-heavy: static batches would keep {occupancy:.0%} of their slots "
                                   f"busy on {basis}, but a batch's prompts take up to {prefill_steps} steps "
                                   "to prefill, which continuous overlaps with decoding")
    if occupancy >= threshold:
        return Policy.STATIC, (f"uniform: static batches would keep {occupancy:.0%} of their slots busy "
                        f"(>= {threshold:.0%}) on {basis}")
    return Policy.CONTINUOUS, (f"mixed: static batches would keep only {occupancy:.0%} of their slots busy "
                        f"(< {threshold:.0%}) on {basis}")
