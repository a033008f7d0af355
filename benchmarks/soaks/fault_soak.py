"""Fault-injection soak of exactly-once output: a writer stalled past its lease, another taking over,
`status` polled throughout, on local disk and on a local S3 server (moto).

    python -m benchmarks.soaks.fault_soak --seeds 100          # every scenario on both stores
    python -m benchmarks.soaks.fault_soak --seeds 5 --store s3 --scenario late_entry  # a quick look at one

Each seed is tests/jobs/fault_harness.run_seed of one scenario (its docstring: "stall",
"late_entry", and on S3 "unfenced", a store that ignores conditional writes; tests/jobs/durability/test_fault_soak.py
runs a few): at the end it prints, per store and scenario, rows lost / duplicated / mixed (a listed
part outside the manifest, or the reverse) / stale (a row of the stalled writer committed after it
lost the lease), status polls that called the manifest damaged, how the stalled writer ended, and
whether every `_SUCCESS` told the truth (checked against the parts that exist); and, on local disk,
up to 20 seeds of two finalizes and a compact racing over a sharded job's OpenAI Batch files
(tests/jobs/durability/finalize_race.py). Exit 1 if any seed failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from batchgen.io.store import lease
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import LocalStore
from tests.jobs.durability.fault_harness import SCENARIOS, run_seed
from tests.jobs.durability.finalize_race import finalize_race
from tests.s3_server import KEY, REGION, SECRET, s3_filesystem


def start_s3() -> tuple[object, str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_REGION=REGION, AWS_EC2_METADATA_DISABLED="true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    return server, endpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--store", choices=["local", "s3", "both"], default="both")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    lease.LEASE_SETTLE_S = 0.05  # no job here races another inside the settle wait
    kinds = ["local", "s3"] if args.store == "both" else [args.store]
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    server, endpoint = start_s3() if "s3" in kinds else (None, None)
    totals = {}
    failed = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for kind, scenario in [(k, s) for k in kinds for s in scenarios
                                   if not (k == "local" and s == "unfenced")]:  # S3 headers only
                keys = ("lost", "duplicated", "mixed", "stale", "damaged_polls", "polls")
                total = dict.fromkeys(keys, 0) | {"seeds": 0, "success_written": 0, "success_all_true": True,
                                                  "stalled_writer_refused": 0, "late_entry_landed": 0,
                                                  "lapsed_before_stall": 0,
                                                  "failed_seeds": []}
                for seed in range(args.seeds):
                    if kind == "local":
                        store = LocalStore(Path(tmp) / f"local-{scenario}-{seed}")
                        store.root.mkdir()
                    else:
                        bucket = f"soak-{uuid.uuid4().hex[:12]}"
                        s3_filesystem(endpoint).create_dir(bucket)
                        store = open_store(f"s3://{bucket}/job")
                    result = run_seed(seed, store, kind, scenario)
                    for key in keys:
                        total[key] += getattr(result, key)
                    total["seeds"] += 1
                    total["success_written"] += result.success
                    total["success_all_true"] &= result.success_true
                    total["stalled_writer_refused"] += result.a_stopped.startswith("refused")
                    total["late_entry_landed"] += result.late_entry_landed
                    total["lapsed_before_stall"] += result.lapsed_before_stall
                    if not result.ok:
                        total["failed_seeds"].append(seed)
                        failed += 1
                        print(f"{kind} {scenario} seed {seed}: {result}", file=sys.stderr)
                if (kind, scenario) == ("local", scenarios[0]):  # the Batch files' race: on local disk, once
                    race = [finalize_race(seed, Path(tmp) / f"race-{seed}") for seed in range(min(args.seeds, 20))]
                    total["finalize_compact_races"] = len(race)
                    total["finalize_compact_bad"] = sum(not r for r in race)
                    failed += total["finalize_compact_bad"]
                totals[f"{kind} {scenario}"] = total
                print(json.dumps({f"{kind} {scenario}": total}))
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({"seeds": args.seeds, "failed": failed, "stores": totals}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
