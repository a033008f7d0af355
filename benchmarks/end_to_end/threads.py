"""OpenMP threads and wait policy for the forward, on a quiet machine and on a shared one.

    python -m benchmarks.end_to_end.threads                      # bf16, both workloads, quiet and 1 busy core, 2 rounds
    python -m benchmarks.end_to_end.threads --busy 0 --rounds 3  # quiet only

Each variant is `batchgen run` at its default flags (a subprocess, as a user runs it) with one
environment change:
  default   batchgen's own choice (batchgen/runtime/omp.py): libgomp's spin-wait on a machine that is quiet
            when the job starts, OMP_WAIT_POLICY=PASSIVE beside busy processes; compute threads
            that follow the cores other processes leave (runtime/threads.py)
  passive-governor  OMP_WAIT_POLICY=PASSIVE always, with the governor (the default until the
            eighth stop)
  spin      the old default: libgomp's wait policy (idle threads spin ~300k iterations at every
            barrier), all cores (OMP_NUM_THREADS pinned, so no governor)
  passive   OMP_WAIT_POLICY=PASSIVE on all cores, no governor
  1thread   OMP_NUM_THREADS=1: one compute thread, the other cores left free (vLLM-CPU's choice on 2 cores)
  spin-governor  libgomp's wait policy with the thread governor (BATCHGEN_OMP_DEFAULTS=0)
  shortspin-governor  idle threads spin 10k iterations (GOMP_SPINCOUNT) then sleep, with the governor

`--busy N` runs each round a second time with N single-threaded busy loops beside the job (nice 0),
the situation of a shared cron box or a CI runner with a neighbour; with `--busy-after S` the
loops start S seconds after the job, a neighbour that arrives mid-job. Variants run round-robin,
start rotating; each run records the CPU the rest of the machine took. Reports generation tok/s
(the job's own wall time) and whole-process tok/s, medians with min-max.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks.common import args_config, write_record
from benchmarks.peers import generate as peers

ALL_CORES = str(len(os.sched_getaffinity(0)))
VARIANTS = {
    "default": {},
    "spin": {"BATCHGEN_OMP_DEFAULTS": "0", "OMP_NUM_THREADS": ALL_CORES},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": ALL_CORES},
    "1thread": {"OMP_NUM_THREADS": "1"},
    "spin-governor": {"BATCHGEN_OMP_DEFAULTS": "0"},
    "passive-governor": {"OMP_WAIT_POLICY": "PASSIVE"},
    "shortspin-governor": {"GOMP_SPINCOUNT": "10000"},
}
# what the variants set, removed from the inherited environment so each runs exactly its own
_OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "BATCHGEN_OMP_DEFAULTS")


@contextlib.contextmanager
def busy_loops(n: int, after_s: float = 0.0):
    code = f"import time\ntime.sleep({after_s})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def variant_env(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _OMP_KEYS}
    env.update(VARIANTS[name])
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="sharegpt,summarize")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", type=int, default=1, help="busy loops in the contended pass (0: quiet pass only)")
    ap.add_argument("--busy-after", type=float, default=0.0,
                    help="seconds after each job starts that the busy loops start (0: before it)")
    ap.add_argument("--busy-only", action="store_true", help="skip the quiet pass")
    ap.add_argument("--n", type=int, default=64, help="ShareGPT rows")
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--num-docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--summary-tokens", type=int, default=64)
    args = ap.parse_args()

    from batchgen.engine.model.loader import load_model

    variants = args.variants.split(",")
    passes = ([] if args.busy_only else [0]) + ([args.busy] if args.busy else [])
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="batchgen-threads-") as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = load_model(None, dtype=args.dtype).tokenizer
        for workload in args.workloads.split(","):
            rows = tmp / f"{workload}.parquet"
            pq.write_table(peers.build_rows(workload, tokenizer, args), rows)
            for busy in passes:
                for r in range(args.rounds):
                    order = variants[r % len(variants):] + variants[: r % len(variants)]
                    for name in order:
                        with busy_loops(busy, args.busy_after if busy else 0.0):
                            rec = peers.run_batchgen(rows, args.dtype, tmp, [], env=variant_env(name))
                        rec["gen_tok_s"] = rec["generated_tokens"] / rec["gen_s"]
                        rec["process_tok_s"] = rec["generated_tokens"] / rec["process_s"]
                        results.setdefault(f"{workload}/busy{busy}/{name}", []).append(rec)
                        print(f"round {r} {workload} busy={busy} {name}: {rec['gen_tok_s']:.1f} gen tok/s, "
                              f"{rec['process_tok_s']:.1f} whole-process (other cores "
                              f"{rec['load'].get('other_cores')})", flush=True)
    report(results)
    write_record({"benchmark": "threads", "args": args_config(args), "results": results}, None)


def report(results: dict[str, list[dict]]) -> None:
    print("\n| workload/busy/variant | gen tok/s median (min-max) | whole-process tok/s | vs spin |")
    print("|---|---:|---:|---:|")
    for key, recs in results.items():
        vals = [r["gen_tok_s"] for r in recs]
        proc = statistics.median(r["process_tok_s"] for r in recs)
        base = results.get(key.rsplit("/", 1)[0] + "/spin")
        ratio = f"{statistics.median(vals) / statistics.median(r['gen_tok_s'] for r in base):.2f}x" if base else ""
        print(f"| {key} | {statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f}) | {proc:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
