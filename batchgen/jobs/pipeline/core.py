"""The job core: planned rows in, finished rows out. It owns the engine, mode switches and the fallback.

The seam every executor builds on (today the local one, `batchgen run`; a sharded or Ray one
would wrap the same core around its own reader and writer):

    core = JobCore(config, loaded)
    for planned, completions in core.generate(plans):  # plans: WindowPlans, pulled lazily
        ...                                             # write, commit, count, learn

A row yields once all of its samples finished (`n`, --n or the row's own: one completion each, by
sample_index), so the executor writes a row's samples in one commit and exactly-once stays a matter
of row ids. A sample that finished before a stop is not checkpointed: its seed and index make it
again, token for token, when the row is resumed.

`generate` pulls a window's rows only when the engine asks for them, so a window is planned with
what the rows before it taught. Consecutive windows planned in one mode stream through one
`engine.generate` call (a "stretch"), so no window boundary drains the engine. The job holds one
engine at a time (EngineSlot): a window in the other mode drops it and builds one with the other
policy over the same model. If a continuous engine fails with an engine error (not a user's error,
and not an exception raised while pulling our own rows), the rows it had not finished and the rest
of that window run again in static mode, and the stretch goes on.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from batchgen.config.choices import Policy
from batchgen.config.constraint import job_constraint
from batchgen.config.job import JobConfig, parse_bytes
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.metrics import EngineMetrics, StepStats
from batchgen.engine.model.loader import LoadedModel
from batchgen.engine.request import Completion, Continuation, Request, SamplingParams
from batchgen.errors import BatchgenError, EngineError
from batchgen.jobs.planning.duplicates import DuplicatePrompts, duplicate_key
from batchgen.jobs.planning.planner import WindowPlan
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.row_sampling import sampling_settings

log = logging.getLogger("batchgen")


def build_engine(config: JobConfig, loaded: LoadedModel, policy: Policy | None = None, *,
                 num_kv_blocks: int | None = None, seq_token_needs: tuple[int, ...] | None = None) -> LLMEngine:
    """An engine with `policy` (default: the config's first, continuous for auto)."""
    engine_config = EngineConfig(
        policy=Policy(policy or config.engine_policy()),
        max_num_seqs=config.batch_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        attention_backend=config.attention_backend,
        cuda_graphs=config.cuda_graphs,
        kv_cache_bytes=parse_bytes(config.kv_cache_memory) if config.kv_cache_memory else None,
        enable_prefix_caching=config.enable_prefix_caching,
        jump_forward=config.jump_forward,
        compile=config.compile,
        kv_cache_dtype=config.kv_cache_dtype,
        max_model_len=loaded.max_context_tokens,
        num_kv_blocks=num_kv_blocks,
        seq_token_needs=seq_token_needs,
        lora_adapters=config.lora or None,
    )
    return LLMEngine(loaded.model, loaded.tokenizer, engine_config, eos_token_ids=loaded.eos_token_ids)


def row_seed(base_seed: int, row_id: Any) -> int:
    """A per-row seed from the job seed and the row id: stable across runs, batches and resumes."""
    digest = hashlib.blake2b(f"{base_seed}\x00{row_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EngineSlot:
    """The job's engine: one at a time, built for the mode of the windows it runs.

    Only one KV cache is ever allocated, sized exactly as a one-mode job's (two caches side by
    side would each get half the memory, or need a split of the budget); the price is one cache
    allocation per mode switch, which consecutive same-mode windows never pay. Every engine after
    the first gets the first one's block count, so each prompt built for the first one fits.
    """

    def __init__(self, config: JobConfig, loaded: LoadedModel):
        self.config = config
        self.loaded = loaded
        self.engine: LLMEngine | None = None
        self.num_kv_blocks: int | None = None
        self.seq_token_needs: tuple[int, ...] | None = None  # a small job's rows: sizes the first cache
        self.metrics: list[EngineMetrics] = []
        self.listeners: list[Callable[[StepStats], None]] = []  # attached to every engine's metrics

    @property
    def policy(self) -> Policy | None:
        """The policy of the engine in the slot: the one that produced the completion just yielded."""
        return None if self.engine is None else Policy(self.engine.config.policy)

    def add_listener(self, listener: Callable[[StepStats], None]) -> None:
        self.listeners.append(listener)
        if self.engine is not None:
            self.engine.metrics.listeners.append(listener)

    def get(self, policy: Policy) -> LLMEngine:
        if self.engine is not None and self.engine.config.policy == policy:
            return self.engine
        self.drop()
        self.engine = build_engine(self.config, self.loaded, policy, num_kv_blocks=self.num_kv_blocks,
                                   seq_token_needs=self.seq_token_needs)
        self.num_kv_blocks = self.engine.kv_cache.num_blocks
        self.metrics.append(self.engine.metrics)
        self.engine.metrics.listeners.extend(self.listeners)
        return self.engine

    def drop(self, *, collect: bool = False) -> None:
        """Free the engine (and its KV cache) before another is built. An engine holds no reference
        cycle, so dropping the last reference frees it; `collect` runs the cycle collector too (not free
        with a model's many objects alive) for one that failed, which exception frames may still reach."""
        if self.engine is None:
            return
        self.engine = None
        if collect:
            gc.collect()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()

    def num_sampled_tokens(self) -> int:
        return sum(m.num_sampled_tokens for m in self.metrics)

    def summary(self) -> dict:
        return EngineMetrics.merged(self.metrics).summary()


class JobCore:
    """Planned windows in, (row, completion) pairs out, in finishing order; see the module docstring."""

    def __init__(self, config: JobConfig, loaded: LoadedModel, *,
                 continuations_for: Callable[[PlannedRow], dict[int, Continuation]] | None = None,
                 between_steps: Callable[[], None] | None = None,
                 refuse_samples: Callable[[PlannedRow], None] | None = None):
        self.config = config
        self.engines = EngineSlot(config, loaded)
        self.continuations_for = continuations_for  # an earlier attempt's tokens for a row's samples, if any
        self.between_steps = between_steps  # called between engine steps (stop, checkpoint)
        # set where the output has no sample_index column: a row asking for n > 1 goes here, not to the engine
        self.refuse_samples = refuse_samples
        self.pending: dict[str, _PendingRow] = {}  # request id -> the row, its request, finished samples
        self.keys = itertools.count()
        self.num_windows = {Policy.STATIC: 0, Policy.CONTINUOUS: 0}
        self.num_static_fallbacks = 0
        self.window_index: int | None = None  # the window whose rows the engine was fed last
        self.constraint = job_constraint(config)  # --json-schema / --regex / --choices; a row's own wins
        self.duplicates = DuplicatePrompts() if config.dedup else None  # copies of a prompt run once
        # of the rows sent to the engine: prompt tokens another row holds too, and those the cache gave
        self.num_shareable_prefix_tokens = 0
        self.num_prefix_hit_prompt_tokens = 0

    def context(self) -> tuple[str | None, int | None]:
        """(engine mode, newest window fed): what a metrics record of this moment is labelled with."""
        policy = self.engines.policy
        return (None if policy is None else policy.value), self.window_index

    def generate(self, plans: Iterator[WindowPlan]) -> Iterator[tuple[PlannedRow, list[Completion]]]:
        plan = next(plans, None)
        while plan is not None:
            stretch = _Stretch(self, plan, plans)
            yield from self._run_stretch(stretch)
            yield from self._served_copies()
            plan = stretch.next_plan
        assert not self.pending, f"{len(self.pending)} rows lost in the engine"
        assert self.duplicates is None or not self.duplicates.num_waiting(), "copies of a prompt lost"

    def _run_stretch(self, stretch: _Stretch) -> Iterator[tuple[PlannedRow, list[Completion]]]:
        while True:
            try:
                engine = self.engines.get(stretch.mode)
                engine.fit_batch_size(stretch.batch_size)
                for completion in engine.generate(stretch, between_steps=self.between_steps):
                    yield from self._finished(completion)
                    yield from self._served_copies()
                return
            except Exception as e:
                if not self._is_engine_fault(stretch, e):
                    raise
                failure = f"{type(e).__name__}: {e}"
            # the rows it had generated part of go on from there (LLMEngine.in_flight: a failed step
            # appended no token, and tokens are a sampled row's whole state); the failed engine's frames went with the
            # exception, so drop() frees its memory
            failed = self.engines.engine
            for request, c in (failed.in_flight() if failed is not None else []):
                self.pending[request.request_id].continuations[request.sample_index or 0] = c
            unfinished = [request for row in self.pending.values() for request in row.requests()]
            log.warning("the continuous engine failed (%s); running its %d unfinished rows and the rest of the "
                        "window in static mode", failure, len(unfinished))
            self.num_static_fallbacks += 1
            self.engines.drop(collect=True)
            static = self.engines.get(Policy.STATIC)
            static.fit_batch_size(stretch.batch_size)
            for completion in static.generate(itertools.chain(unfinished, stretch.window_rest),
                                              between_steps=self.between_steps):
                yield from self._finished(completion)
                yield from self._served_copies()
            if stretch.done:
                return

    def _is_engine_fault(self, stretch: _Stretch, e: Exception) -> bool:
        """A continuous engine's own failure: an EngineError or a non-batchgen exception raised by
        the engine, not by our request stream, and not a user's mistake."""
        if stretch.mode != Policy.CONTINUOUS or stretch.failed:
            return False
        return isinstance(e, EngineError) or not isinstance(e, BatchgenError)

    def in_flight(self) -> list[tuple[PlannedRow, int, Continuation]]:
        """The samples in the engine that have generated tokens (row, sample index, its tokens so
        far); call between steps (batchgen.engine.engine.LLMEngine.in_flight)."""
        engine = self.engines.engine
        if engine is None:
            return []
        return [(self.pending[request.request_id].planned, request.sample_index or 0, continuation)
                for request, continuation in engine.in_flight()]

    def _finished(self, completion: Completion) -> Iterator[tuple[PlannedRow, list[Completion]]]:
        row = self.pending[completion.request_id]
        row.done[completion.sample_index] = completion
        if completion.sample_index == 0:  # a row's other samples share its prompt whatever the order
            self.num_prefix_hit_prompt_tokens += completion.num_cached_prompt_tokens
        if len(row.done) == row.request.sampling.n:
            del self.pending[completion.request_id]
            completions = [row.done[i] for i in range(row.request.sampling.n)]
            yield row.planned, completions
            if self.duplicates is not None:
                yield from self.duplicates.served(completion.request_id, completions)

    def _served_copies(self) -> Iterator[tuple[PlannedRow, list[Completion]]]:
        """Copies of prompts whose leader had finished when they were planned."""
        if self.duplicates is not None:
            yield from self.duplicates.take_ready()

    def window_requests(self, plan: WindowPlan) -> Iterator[Request]:
        config = self.config
        self.num_windows[plan.mode] += 1
        self.window_index = plan.index
        log.info("window %d (%s, %d rows from row %d): %s; %s", plan.index, plan.path, plan.num_rows,
                 plan.first_row_index, plan.mode, plan.reason)
        for planned in plan.rows:
            if self.refuse_samples is not None and planned.num_samples > 1:
                self.refuse_samples(planned)
                continue
            key = str(next(self.keys))
            request = Request(key, planned.prompt_token_ids, SamplingParams(
                max_new_tokens=planned.max_new_tokens,
                seed=planned.seed if planned.seed is not None else row_seed(config.seed, planned.row.row_id),
                stop=planned.stop if planned.stop is not None else tuple(config.stop), ignore_eos=config.ignore_eos,
                stop_token_ids=tuple(config.stop_token_ids),
                include_stop_str_in_output=config.include_stop_str_in_output,
                skip_special_tokens=config.skip_special_tokens,
                logprobs=planned.logprobs if planned.logprobs is not None else config.logprobs,
                constraint=planned.constraint if planned.constraint is not None else self.constraint,
                **sampling_settings(config, planned.sampling, planned.max_new_tokens)),
                predicted_num_output_tokens=planned.prediction.p90, adapter=planned.adapter,
                prefix_leader_id=planned.prefix_leader.request_id if planned.prefix_leader is not None else None)
            planned.request_id = key
            row = _PendingRow(planned, request,
                              self.continuations_for(planned) if self.continuations_for is not None else {})
            if self.duplicates is not None and not row.continuations:  # a continued row is its own
                if not self.duplicates.admit(planned, request, duplicate_key(request, planned.seed is not None)):
                    continue
            self.pending[key] = row
            self.num_shareable_prefix_tokens += planned.num_shared_prefix_tokens
            yield from row.requests()


@dataclasses.dataclass(slots=True)
class _PendingRow:
    """A row in the engine: its request (sampling.n samples) and the samples finished so far."""

    planned: PlannedRow
    request: Request
    continuations: dict[int, Continuation]  # sample index -> the tokens an earlier attempt generated
    done: dict[int, Completion] = dataclasses.field(default_factory=dict)  # sample index -> its completion

    def requests(self) -> list[Request]:
        """What the engine gets for the samples not finished: one request for all n when none has
        earlier tokens (the engine makes the samples), else one per sample (sample_index)."""
        n = self.request.sampling.n
        if n == 1:
            return [dataclasses.replace(self.request, continuation=self.continuations.get(0))] if not self.done else []
        if not self.continuations and not self.done:
            return [self.request]
        return [dataclasses.replace(self.request, sample_index=i, continuation=self.continuations.get(i))
                for i in range(n) if i not in self.done]


class _Stretch:
    """The requests of consecutive windows planned in one mode: what one engine.generate call pulls.

    It ends before the first window planned in another mode (`next_plan`, where the next stretch
    begins). `window_rest` is the window in progress' requests not handed out yet, which a static
    fallback takes over. Pulling a request may read input, plan a window and write error rows:
    an exception raised there (`failed`) is ours and never blamed on the engine.
    """

    def __init__(self, core: JobCore, first: WindowPlan, plans: Iterator[WindowPlan]):
        self.mode = first.mode
        self.batch_size = first.batch_size  # the first window's: an engine's batch is set while it is idle
        self.next_plan: WindowPlan | None = None
        self.window_rest: Iterator[Request] = iter(())
        self.failed = False
        self.done = False  # every request of the stretch has been handed out
        self._requests = self._pull(core, first, plans)

    def __iter__(self) -> Iterator[Request]:
        return self._requests

    def _pull(self, core: JobCore, plan: WindowPlan, plans: Iterator[WindowPlan]) -> Iterator[Request]:
        try:
            while True:
                self.window_rest = core.window_requests(plan)
                yield from self.window_rest
                plan = next(plans, None)
                if plan is None or plan.mode != self.mode:
                    self.next_plan = plan
                    break
            self.done = True
        except Exception:
            self.failed = True
            raise
