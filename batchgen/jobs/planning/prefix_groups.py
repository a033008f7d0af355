"""Prefix groups: rows that share a prompt prefix run together, so the prefix is computed once.

Backfills repeat themselves: several questions on one document, one instruction and few-shot
examples ahead of every row. The rows of one document arrive scattered; run in input order, each
prefills the document again once the cache has moved on, and rows admitted in one step each
prefill it side by side. A batch job can see the rows before it runs them.

Look-ahead. The planner reads up to `LOOKAHEAD_WINDOWS` windows of one file ahead (fewer where
their prompts pass `MAX_LOOKAHEAD_TOKENS`), so memory stays bounded on inputs of any size; rows of
one document farther apart than that are grouped in neither look-ahead (they still hit the prefix
cache when it holds the document).

Groups. Each prompt becomes its chained block hashes (one per full block of `block_size` tokens,
as the prefix cache keys them: engine/kv/block_manager.py); sorting the look-ahead by them puts
rows that share a prefix next to each other, and neighbours' shared blocks are what the prefix
cache can give. The look-ahead's common prefix (a template's or system prompt's blocks ahead of
every row) is no grouping: a group is a run of sorted neighbours that share at least one full
block beyond it. A group takes the input position of its first row and keeps its rows together;
windows are filled group by group, a group split only when it alone outgrows a window. The planner
then orders each window's groups longest predicted output first (planner.sort_by_length), so the
longest-first rule holds between groups.

Leaders. Within a group the first row to run leads: the engine starts every other row of the
group from the leader's blocks, waiting while the leader computes them (engine/scheduler/samples.py),
rather than each computing the document side by side. Where the look-ahead has a common prefix, the
first row of its first window leads every row's common part the same way.

A row whose whole prompt and own settings equal another's of the look-ahead is marked
(`repeats_prompt`): `batchgen plan` counts it among the rows --dedup serves (jobs/planning/duplicates.py).

Shareable tokens: a row's full prompt blocks already in another row of the look-ahead (sorted
neighbours' shared blocks, its last token excluded as the cache excludes it); their sum is the
prompt work a perfect cache saves, counted with or without --prefix-order, so that a run's
prefix-hit tokens can be put against it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from batchgen.engine.kv.block_manager import chain_hash
from batchgen.engine.scheduler.samples import num_common_tokens
from batchgen.jobs.rows.planned_row import PlannedRow

LOOKAHEAD_WINDOWS = 8  # windows of rows read ahead to find the rows that share a prefix
MAX_LOOKAHEAD_TOKENS = 1 << 21  # prompt tokens held in the look-ahead at most (its memory bound: ~40 bytes each)


def lookaheads(rows: Iterable[PlannedRow], max_rows: int, max_tokens: int = MAX_LOOKAHEAD_TOKENS
               ) -> Iterator[list[PlannedRow]]:
    """Consecutive rows of one file, at most max_rows of them and about max_tokens of prompt."""
    buffer: list[PlannedRow] = []
    num_tokens = 0
    for r in rows:
        if buffer and (len(buffer) >= max_rows or num_tokens + r.num_prompt_tokens > max_tokens
                       or r.row.file.path != buffer[0].row.file.path):
            yield buffer
            buffer, num_tokens = [], 0
        buffer.append(r)
        num_tokens += r.num_prompt_tokens
    if buffer:
        yield buffer


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hash of each full block of a prompt before its last token (what a cache may hold)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size, block_size):
        parent = chain_hash(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixGrouper:
    """Look-aheads of rows -> windows whose rows sharing a prefix sit together (module docstring)."""

    def __init__(self, window_rows: int, block_size: int, *, reorder: bool,
                 lookahead_rows: int | None = None, max_lookahead_tokens: int = MAX_LOOKAHEAD_TOKENS):
        self.window_rows = window_rows
        self.block_size = block_size
        self.reorder = reorder  # False: only count the shareable tokens, rows keep input order
        self.lookahead_rows = lookahead_rows or LOOKAHEAD_WINDOWS * window_rows
        self.max_lookahead_tokens = max_lookahead_tokens
        self._group_ids = itertools.count()
        self.num_lookaheads = 0
        self.num_shareable_tokens = 0  # over every row grouped so far

    def windows(self, rows: Iterable[PlannedRow]) -> Iterator[list[PlannedRow]]:
        for buffer in lookaheads(rows, self.lookahead_rows, self.max_lookahead_tokens):
            ordered = self.group(buffer)
            yield from self._pack(ordered)

    def group(self, buffer: list[PlannedRow]) -> list[PlannedRow]:
        """Set each row's shareable tokens and (reordering) its group; the rows in their new order."""
        bs = self.block_size
        lookahead = self.num_lookaheads
        self.num_lookaheads += 1
        hashes = [block_hashes(r.prompt_token_ids, bs) for r in buffer]
        # then by the rest of the prompt, so that rows with the same whole prompt sit side by side
        order = sorted(range(len(buffer)), key=lambda i: (hashes[i], buffer[i].prompt_token_ids[len(hashes[i]) * bs:]))
        shared = [0] * len(order)  # blocks each sorted row shares with the row sorted before it
        for p in range(1, len(order)):
            shared[p] = num_common_tokens(hashes[order[p - 1]], hashes[order[p]])
        common = min(shared[1:], default=0)  # every row's: the look-ahead's common prefix, in blocks
        group_of = [-1] * len(buffer)  # input position -> group id (-1: a row of its own)
        for p, i in enumerate(order):
            r = buffer[i]
            r.num_shared_prefix_tokens = shared[p] * bs
            self.num_shareable_tokens += shared[p] * bs
            r.prefix_group = None
            r.prefix_leader = None
            r.common_prefix_lookahead = lookahead if common else None
            previous = buffer[order[p - 1]] if p else None
            r.repeats_prompt = (previous is not None and previous.prompt_token_ids == r.prompt_token_ids
                                and previous.settings_key == r.settings_key)
            if p and shared[p] > common:
                first = order[p - 1]
                if group_of[first] < 0:
                    group_of[first] = next(self._group_ids)
                group_of[i] = group_of[first]
        if not self.reorder:
            return list(buffer)
        members: dict[int, list[PlannedRow]] = {}
        ordered: list[PlannedRow | list[PlannedRow]] = []
        for i, r in enumerate(buffer):
            g = group_of[i]
            if g < 0:
                ordered.append(r)
                continue
            r.prefix_group = g
            if g not in members:
                members[g] = []
                ordered.append(members[g])  # the group's place: its first row's
            members[g].append(r)
        return [r for item in ordered for r in (item if isinstance(item, list) else [item])]

    def _pack(self, ordered: list[PlannedRow]) -> Iterator[list[PlannedRow]]:
        """Windows of at most window_rows rows that split no group smaller than a window."""
        window: list[PlannedRow] = []
        for group in _runs(ordered):
            if window and len(window) + len(group) > self.window_rows and len(group) <= self.window_rows:
                yield window
                window = []
            for r in group:
                if len(window) >= self.window_rows:
                    yield window
                    window = []
                window.append(r)
        if window:
            yield window


def _runs(ordered: list[PlannedRow]) -> Iterator[list[PlannedRow]]:
    """The ordered rows as runs of one group each (a row of its own: a run of one)."""
    run: list[PlannedRow] = []
    for r in ordered:
        if run and (r.prefix_group is None or r.prefix_group != run[0].prefix_group):
            yield run
            run = []
        run.append(r)
    if run:
        yield run


def assign_leaders(rows: list[PlannedRow], lookahead_leaders: dict[int, PlannedRow], block_size: int) -> None:
    """Rows of a window in run order: each group's first row leads the group; the first row of a
    look-ahead with a common prefix leads every other row of it there (module docstring).
    `lookahead_leaders` keeps that row across the look-ahead's windows. Each follower's
    `num_leader_prefix_tokens` is what it starts from: the leader's full blocks of their common
    prefix (the engine's rule, engine/scheduler/samples.py), which is what the planner's KV
    reservations leave out; the shareable tokens, counted between sorted neighbours, can sit on
    another row of the group than the one that runs first."""
    group_leaders: dict[int, PlannedRow] = {}
    if rows and rows[0].common_prefix_lookahead not in lookahead_leaders:
        lookahead_leaders.clear()  # a window holds rows of one look-ahead: the ones before are done
    for r in rows:
        r.prefix_leader = None
        r.num_leader_prefix_tokens = 0
        leader = None
        if r.prefix_group is not None:
            leader = group_leaders.setdefault(r.prefix_group, r)
        if (leader is None or leader is r) and r.common_prefix_lookahead is not None:
            leader = lookahead_leaders.setdefault(r.common_prefix_lookahead, r)
        if leader is not None and leader is not r:
            r.prefix_leader = leader
            r.num_leader_prefix_tokens = leader_prefix_tokens(leader, r, block_size)


def leader_prefix_tokens(leader: PlannedRow, r: PlannedRow, block_size: int) -> int:
    """Prompt tokens of the full blocks `r` takes from `leader`: their common prefix, short of
    either's last prompt token (always computed), in whole blocks."""
    num_common = num_common_tokens(leader.prompt_token_ids, r.prompt_token_ids)
    return min(num_common, leader.num_prompt_tokens - 1, r.num_prompt_tokens - 1) // block_size * block_size
