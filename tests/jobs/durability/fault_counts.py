"""What one seed of the fault soak (tests/jobs/durability/fault_harness.py) counts: rows lost, duplicated,
"mixed" (a listed part that no entry commits, or a committed part that is not there) and "stale"
(a row of the stalled writer committed after it lost the lease), read as a plain listing and
through the manifest, and whether `_SUCCESS` tells the truth about the parts that exist."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from batchgen.io.manifest.manifest import PART_NAME_RE, SUCCESS_FILE, load_manifest
from batchgen.io.store.store import OutputStore

NUM_ROWS = 40


@dataclass
class SeedResult:
    seed: int
    store: str
    scenario: str = "stall"
    lost: int = 0
    duplicated: int = 0
    mixed: int = 0
    stale: int = 0
    success: bool = False  # _SUCCESS present at the end
    success_true: bool = True  # where present: the listing holds every row once, and only committed parts
    damaged_polls: int = 0
    polls: int = 0
    a_stopped: str = ""  # how the stalled writer ended
    b_failed: str = ""  # the error that ended the new holder's run, if one did
    late_entry_landed: bool = False  # "late_entry": A's entry landed after B took over, before B wrote any
    lapsed_before_stall: bool = False  # A's lease ran out before its stall: the retry finished the job
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if self.scenario == "unfenced":  # refused, and nothing left on the store ("mixed": objects there)
            return self.a_stopped.startswith("refused") and not self.success and not self.mixed
        return not (self.lost or self.duplicated or self.mixed or self.stale or self.damaged_polls
                    or self.b_failed or self.a_stopped.startswith("failed")) and self.success and self.success_true


def listed_parts(store: OutputStore) -> list[str]:
    return sorted(name for name in store.list() if PART_NAME_RE.fullmatch(name))


def count(store: OutputStore, result: SeedResult, a_late: set[int]) -> None:
    """Rows lost / duplicated / mixed / stale, and whether _SUCCESS told the truth."""
    listed = listed_parts(store)
    state = load_manifest(store)
    committed = set(state.parts)
    result.mixed = len(set(listed) ^ committed)
    ids, texts = [], []
    for name in listed:
        table = store.read_table(name)
        ids += table.column("id").to_pylist()
        texts += table.column("text").to_pylist()
    seen = set(ids)
    result.lost = len(set(range(NUM_ROWS)) - seen)
    result.duplicated = len(ids) - len(seen)
    # after B took over, any A row of an id A had not committed before its stall is one it committed late
    b_took_over = any(t.startswith("B:") for t in texts)
    late = sum(t.startswith("A:") and i in a_late for i, t in zip(ids, texts, strict=True))
    result.stale = late if b_took_over else 0
    result.success = store.exists(SUCCESS_FILE)
    if result.success:
        vouched = json.loads(store.read_bytes(SUCCESS_FILE)).get("rows")
        result.success_true = (not result.mixed and not result.lost and not result.duplicated
                               and vouched == len(ids) == NUM_ROWS)
