"""A few seeds of the fault-injection soak (tests/jobs/durability/fault_harness.py; benchmarks/soaks/fault_soak.py runs
many): a writer stalled past its lease while another takes over, `status` polled throughout. Every
row exactly once, no part outside the manifest, no stale row, and `_SUCCESS` tells the truth; a
store that ignores conditional writes is refused before anything is written."""

from __future__ import annotations

import pytest

from batchgen.io.store.factory import open_store
from batchgen.io.store.store import LocalStore
from tests.jobs.durability.fault_harness import run_seed
from tests.jobs.durability.finalize_race import finalize_race

pytestmark = [pytest.mark.soak, pytest.mark.usefixtures("quick_lease_settle")]


@pytest.mark.parametrize("scenario", ["stall", "late_entry"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_local_disk(tmp_path, seed, scenario):
    result = run_seed(seed, LocalStore(tmp_path), "local", scenario)
    assert result.ok, result
    assert result.a_stopped == "finished"  # the flock held while A stalled: B was refused


@pytest.mark.parametrize("scenario", ["stall", "late_entry"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_s3(s3_out, seed, scenario):
    result = run_seed(seed, open_store(s3_out), "s3", scenario)
    assert result.ok, result
    assert result.a_stopped.startswith("refused")  # A lost the lease while stalled: it committed nothing more


@pytest.mark.parametrize("seed", [0, 1])
def test_s3_ignoring_conditional_writes_is_refused(s3_out, seed):
    result = run_seed(seed, open_store(s3_out), "s3", "unfenced")
    assert result.ok, result


@pytest.mark.parametrize("seed", [0, 1])
def test_finalize_and_compact_racing(tmp_path, seed):
    assert finalize_race(seed, tmp_path / "out")
