"""kill -9 soak: a `batchgen run` subprocess SIGKILLed at random moments, resumed until done.

    python -m benchmarks.soak_kill --seeds 100 --kills 2   # the closing-note figures
    python -m benchmarks.soak_kill --seeds 5               # a quick look

The cycle lives with the tests (tests/jobs/kill_harness.py, which tests/jobs/test_kill.py runs for
fewer seeds): per seed the job is SIGKILLed up to --kills times, each time restarted, then run to
the end; --jobs seeds run at once. At the end: every input id exactly once, output == the
reference, and a rerun processes 0 rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from tests.jobs.kill_harness import (
    COMMIT_EVERY,
    SeedResult,
    check_final,
    kill_cycle,
    make_fixture,
    run_to_end_subprocess,
    timed_reference,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=240)
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per seed before the run to the end")
    parser.add_argument("--jobs", type=int, default=2, help="seeds run at once (each in its own directory)")
    parser.add_argument("--json", type=Path, help="write the per-seed results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchgen-soak-") as tmp:
        tmp = Path(tmp)
        fixture = make_fixture(tmp, args.rows)
        reference, job_s = timed_reference(fixture, tmp / "reference")
        print(f"reference run: {args.rows} rows, {job_s:.2f} s from taking the lock to _SUCCESS", flush=True)
        t0 = time.monotonic()

        def one_seed(seed: int) -> SeedResult:
            out = tmp / f"seed-{seed}"
            result = kill_cycle(fixture, out, seed, kills=args.kills, max_delay_s=job_s)
            run_to_end_subprocess(fixture, out)
            check_final(out, fixture, reference, result)
            result.rerun_rows = run_to_end_subprocess(fixture, out)
            print(f"seed {seed}: {result.kills} kills at {result.kill_delays_s} s, committed then "
                  f"{result.committed_at_kill}; lost {result.rows_lost}, duplicated {result.rows_duplicated}, "
                  f"missing {result.rows_missing}, wrong {result.rows_wrong}, rerun {result.rerun_rows}", flush=True)
            shutil.rmtree(out)  # keep the temp dir small
            return result

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(one_seed, range(args.first_seed, args.first_seed + args.seeds)))
        totals = {key: sum(getattr(r, key) for r in results)
                  for key in ("kills", "rows_lost", "rows_duplicated", "rows_missing", "rows_wrong", "rerun_rows")}
        mid_commit = sum(0 < c < args.rows for r in results for c in r.committed_at_kill)
        summary = {"seeds": len(results), "rows_per_job": args.rows, "commit_every": COMMIT_EVERY,
                   "kills_with_partial_output": mid_commit, "wall_s": round(time.monotonic() - t0, 1), **totals}
        print(json.dumps(summary))
        if args.json:
            args.json.write_text(json.dumps({"summary": summary, "seeds": [asdict(r) for r in results]}, indent=1))
        bad = totals["rows_lost"] + totals["rows_duplicated"] + totals["rows_missing"] + totals["rows_wrong"]
        sys.exit(1 if bad or totals["rerun_rows"] else 0)


if __name__ == "__main__":
    main()
