"""The job's counters, summed over everything its metrics files hold (every run of a resumed job).

Prometheus counters must never go backwards, and a resumed job is the same job: its counters
start from what the earlier runs wrote to `_metrics/` and grow by what this run writes. The
counters a run exports are exactly what it has written to disk so far (never its in-memory
figures), so the next run, seeded from the files, starts at or above anything exported before,
even after a kill -9.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from batchgen.monitor.store import read_kind

# counter field -> (kind, column) it sums
SOURCES = {
    "num_generated_tokens": ("steps", "num_sampled_tokens"),
    "num_engine_steps": ("steps", "num_steps"),
    "engine_seconds": ("steps", "step_seconds_sum"),
    "num_preemptions": ("steps", "num_preemptions"),
    "num_prefix_hit_tokens": ("steps", "num_prefix_hit_tokens"),
    "num_rows": ("rows", "num_rows"),
    "num_rows_error": ("rows", "num_rows_error"),
    "num_shareable_prefix_tokens": ("rows", "num_shareable_prefix_tokens"),
    "num_prefix_hit_prompt_tokens": ("rows", "num_prefix_hit_prompt_tokens"),
    "num_rows_from_duplicates": ("rows", "num_rows_from_duplicates"),
    "num_commits": ("commits", "num_commits"),
}


@dataclass(slots=True)
class Totals:
    num_generated_tokens: int = 0  # sampled by the engine (a killed run's unfinished rows' tokens count too)
    num_engine_steps: int = 0
    engine_seconds: float = 0.0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_rows: int = 0  # rows finished (retried error rows count again)
    num_rows_error: int = 0
    # of the rows finished (monitor/records.py): what they shared with other rows; 0 in older files
    num_shareable_prefix_tokens: int = 0
    num_prefix_hit_prompt_tokens: int = 0
    num_rows_from_duplicates: int = 0
    num_commits: int = 0

    @classmethod
    def from_dir(cls, directory: Path) -> Totals:
        out = cls()
        by_kind: dict[str, list[str]] = {}
        for kind, column in SOURCES.values():
            by_kind.setdefault(kind, []).append(column)
        for kind, columns in by_kind.items():
            table = read_kind(directory, kind, columns=columns)
            for name, (k, column) in SOURCES.items():
                if k == kind and table.num_rows:
                    setattr(out, name, type(getattr(out, name))(pc.sum(table[column]).as_py() or 0))
        return out

    def add_records(self, kind: str, records: list[dict[str, Any]]) -> None:
        for name, (k, column) in SOURCES.items():
            if k == kind:
                setattr(self, name, getattr(self, name) + sum(r[column] for r in records))

    def copy(self) -> Totals:
        return Totals(**{f.name: getattr(self, f.name) for f in fields(self)})
