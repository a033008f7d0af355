"""kill -9 soak: a `batchgen run` subprocess SIGKILLed at random moments, resumed until done.

    python -m benchmarks.soaks.soak_kill --seeds 100 --kills 2   # the closing-note figures
    python -m benchmarks.soaks.soak_kill --seeds 5               # a quick look
    python -m benchmarks.soaks.soak_kill --seeds 100 --kills 3 --change-inputs   # inputs change between kills

The cycle lives with the tests (tests/jobs/kill_harness.py, which tests/jobs/durability/test_kill.py runs for
fewer seeds): per seed the job is SIGKILLed up to --kills times, each time restarted, then run to
the end; --jobs seeds run at once. At the end: every input id exactly once, output == the
reference, and a rerun processes 0 rows.

--change-inputs: the job reads a directory, and after each kill its inputs change
(tests/jobs/changing_inputs.py: rows appended, a file added, prompts edited under --id-column);
changes the kills did not reach are made before the final run. The reference is one uninterrupted
run over the final inputs: every id exactly once, none generated from an old prompt ("stale").
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

from tests.jobs.changing_inputs import (
    NUM_CHANGES,
    apply_all,
    apply_change,
    copy_fixture,
    make_changing_fixture,
)
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
    parser.add_argument("--change-inputs", action="store_true", help="change the inputs between kills")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchgen-soak-") as tmp:
        tmp = Path(tmp)
        if args.change_inputs:
            fixture = make_changing_fixture(tmp, args.rows)
            final = copy_fixture(fixture, tmp / "final-inputs")
            apply_all(final, 0)
            reference, job_s, _ = timed_reference(final, tmp / "reference")
        else:
            fixture = make_fixture(tmp, args.rows)
            reference, job_s, _ = timed_reference(fixture, tmp / "reference")
        print(f"reference run: {len(reference)} rows, {job_s:.2f} s from taking the lock to _SUCCESS", flush=True)
        t0 = time.monotonic()

        def one_seed(seed: int) -> SeedResult:
            out = tmp / f"seed-{seed}"
            job = fixture
            change = None
            if args.change_inputs:
                job = copy_fixture(fixture, tmp / f"inputs-{seed}")

                def change(k: int) -> None:
                    if k < NUM_CHANGES:
                        apply_change(job, k)

            result = kill_cycle(job, out, seed, kills=args.kills, max_delay_s=job_s, between_kills=change)
            if args.change_inputs:
                apply_all(job, len(result.changes))
            run_to_end_subprocess(job, out)
            check_final(out, job, reference, result)
            result.rerun_rows = run_to_end_subprocess(job, out)
            print(f"seed {seed}: {result.kills} kills at {result.kill_delays_s} s, committed then "
                  f"{result.committed_at_kill}; lost {result.rows_lost}, duplicated {result.rows_duplicated}, "
                  f"missing {result.rows_missing}, wrong {result.rows_wrong}, stale {result.rows_stale}, "
                  f"rerun {result.rerun_rows}", flush=True)
            shutil.rmtree(out)  # keep the temp dir small
            if args.change_inputs:
                shutil.rmtree(job.input)
            return result

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(one_seed, range(args.first_seed, args.first_seed + args.seeds)))
        totals = {key: sum(getattr(r, key) for r in results)
                  for key in ("kills", "rows_lost", "rows_duplicated", "rows_missing", "rows_wrong", "rows_stale",
                              "rerun_rows")}
        mid_commit = sum(0 < c < args.rows for r in results for c in r.committed_at_kill)
        summary = {"seeds": len(results), "rows_per_job": len(reference), "commit_every": COMMIT_EVERY,
                   "change_inputs": args.change_inputs,
                   "kills_with_partial_output": mid_commit, "wall_s": round(time.monotonic() - t0, 1), **totals}
        print(json.dumps(summary))
        if args.json:
            args.json.write_text(json.dumps({"summary": summary, "seeds": [asdict(r) for r in results]}, indent=1))
        bad = (totals["rows_lost"] + totals["rows_duplicated"] + totals["rows_missing"] + totals["rows_wrong"]
               + totals["rows_stale"])
        sys.exit(1 if bad or totals["rerun_rows"] else 0)


if __name__ == "__main__":
    main()
