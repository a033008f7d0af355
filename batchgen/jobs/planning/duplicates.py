"""Duplicate prompts run once: rows whose output is decided by their prompt and settings alone.

Scraped inputs and labelling backfills repeat prompts; a batch job sees every row before it runs
it, so a copy need not be generated again. A row is a copy of another when its prompt token ids
and every sampling setting are the same, and its output does not depend on its id: greedy rows
(the seed is unused), or sampled rows with the same explicit seed (a Batch API request's). A
sampled row whose seed derives from its id, a row asking for n samples, and a row continuing its
own checkpointed tokens are never served from a copy.

The first row of a key (the leader) runs; copies that arrive while it runs wait on it, and copies
that arrive after it finished take its completions from a bounded cache (by tokens held), so the
copies of a key spread over many planning windows still run once. Each copy is written under its
own id, in the same commit path as any row: exactly-once stays a matter of ids, and a resume
after a kill runs whichever copies were not committed, the first of them as a new leader.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Iterator

from batchgen.config.job import JobConfig
from batchgen.engine.request import Completion, Request
from batchgen.jobs.rows.planned_row import PlannedRow

# completions kept for copies that arrive after their leader finished, counted in token ids held
MAX_CACHED_TOKENS = 1 << 20


def duplicate_key(request: Request, explicit_seed: bool) -> bytes | None:
    """The key under which rows give the same output, or None for a row that must run itself. A
    row continuing its own checkpointed tokens is never offered (JobCore.window_requests)."""
    sampling = request.sampling
    if sampling.n != 1:
        return None
    greedy = sampling.temperature == 0.0
    if not greedy and not explicit_seed:  # its seed derives from its row id: its own draw
        return None
    constraint = sampling.constraint
    settings = dataclasses.replace(sampling, seed=None if greedy else sampling.seed, constraint=None)
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(settings).encode())
    h.update(b"\x00" + (constraint.describe() if constraint is not None else "").encode())
    h.update(b"\x00" + ",".join(map(str, request.prompt_token_ids)).encode())
    h.update(b"\x00" + (request.adapter or "").encode())  # another adapter is another model
    return h.digest()


def planned_copy(config: JobConfig, planned: PlannedRow) -> bool:
    """Whether --dedup serves this row from another row's run, as `batchgen plan` can tell it: its
    prompt and own settings repeat another row's of its look-ahead (planning/prefix_groups.py), and
    its output is decided by them (one sample, greedy or an explicit seed)."""
    greedy = (planned.sampling or {}).get("temperature", config.temperature) == 0
    return (config.dedup and planned.repeats_prompt and planned.num_samples == 1
            and (greedy or planned.seed is not None))


def reuse_counts(planned: PlannedRow, first: Completion) -> tuple[int, int]:
    """(shareable prefix tokens, prefix-hit prompt tokens) a finished row adds to the job's figures,
    `first` its first sample's completion: as JobCore counts the rows it sends to the engine, so a
    copy served from another row's run adds neither (it computed nothing and read no cache)."""
    if planned.served_from_duplicate:
        return 0, 0
    return planned.num_shared_prefix_tokens, first.num_cached_prompt_tokens


class DuplicatePrompts:
    """Which running row each copy waits on, and the finished leaders' completions."""

    def __init__(self, max_cached_tokens: int = MAX_CACHED_TOKENS):
        self.max_cached_tokens = max_cached_tokens
        self.leaders: dict[bytes, str] = {}  # key -> the running leader's request id
        self.keys: dict[str, bytes] = {}  # the running leader's request id -> its key
        self.copies: dict[str, list[PlannedRow]] = {}  # leader request id -> copies waiting on it
        self.finished: OrderedDict[bytes, list[Completion]] = OrderedDict()  # least recently used first
        self.num_cached_tokens = 0
        self.ready: list[tuple[PlannedRow, list[Completion]]] = []  # copies served from the cache, to yield
        self.num_rows_served = 0

    def admit(self, planned: PlannedRow, request: Request, key: bytes | None) -> bool:
        """True when `planned` runs (a leader or a row of its own); False when it is a copy, served
        when its leader finishes or (finished already) queued in `ready`."""
        if key is None:
            return True
        cached = self.finished.get(key)
        if cached is not None:
            self.finished.move_to_end(key)
            self.ready.append((planned, self._copies_of(cached, request.request_id)))
            self._serve(planned)
            return False
        leader = self.leaders.get(key)
        if leader is not None:
            self.copies[leader].append(planned)
            self._serve(planned)
            return False
        self.leaders[key] = request.request_id
        self.keys[request.request_id] = key
        self.copies[request.request_id] = []
        return True

    def _serve(self, planned: PlannedRow) -> None:
        planned.served_from_duplicate = True
        self.num_rows_served += 1

    def served(self, request_id: str, completions: list[Completion]) -> Iterator[tuple[PlannedRow, list[Completion]]]:
        """The copies waiting on a leader that finished with `completions`; caches them for later copies."""
        key = self.keys.pop(request_id, None)
        if key is None:
            return
        del self.leaders[key]
        for planned in self.copies.pop(request_id):
            yield planned, self._copies_of(completions, request_id)
        self._cache(key, completions)

    def take_ready(self) -> list[tuple[PlannedRow, list[Completion]]]:
        ready, self.ready = self.ready, []
        return ready

    def num_waiting(self) -> int:
        return sum(len(copies) for copies in self.copies.values()) + len(self.ready)

    def _cache(self, key: bytes, completions: list[Completion]) -> None:
        num_tokens = sum(len(c.token_ids) for c in completions)
        if num_tokens > self.max_cached_tokens:
            return
        self.finished[key] = completions
        self.num_cached_tokens += num_tokens
        while self.num_cached_tokens > self.max_cached_tokens:
            _, dropped = self.finished.popitem(last=False)
            self.num_cached_tokens -= sum(len(c.token_ids) for c in dropped)

    @staticmethod
    def _copies_of(completions: list[Completion], request_id: str) -> list[Completion]:
        """A copy's completions: the leader's tokens and text; its whole prompt came from the leader."""
        return [dataclasses.replace(c, request_id=request_id, num_cached_prompt_tokens=c.num_prompt_tokens,
                                    num_preemptions=0) for c in completions]
