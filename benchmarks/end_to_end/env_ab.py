"""batchgen at its default flags with an environment variable on and off, alternating, by CPU cost.

    python -m benchmarks.end_to_end.env_ab --var BATCHGEN_KERNEL_CACHE_DEFAULTS --values 1,0 --pairs 2

ShareGPT rows as `benchmarks/peers/generate.py` builds them (--n rows, outputs <= --max-output-len), run as
peers runs `batchgen run` (default flags, --dtype, --no-chat, --ignore-eos, the per-row budget),
each value in turn, the order flipped every pair. Beside the job's tokens/s (its own wall time),
the process' CPU seconds (user + sys, from wait4) per generated token: on a machine shared with
other work the wall figures move with the neighbours, the CPU cost of the same tokens much less.
One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks import sysload
from benchmarks.peers.generate import build_rows


def run_once(rows: Path, out: Path, dtype: str, env: dict[str, str]) -> dict:
    cmd = [str(Path(sys.executable).parent / "batchgen"), "run", "--input", str(rows), "--output", str(out),
           "--dtype", dtype, "--no-chat", "--ignore-eos", "--max-new-tokens-column", "max_new_tokens",
           "--id-column", "id", "--quiet"]
    with sysload.measure() as load:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
    if status:
        raise RuntimeError(f"batchgen failed: {proc.stderr.read()[-2000:]}")
    summary = json.loads((out / "_summary.json").read_text())
    tokens, cpu = summary["num_generated_tokens"], usage.ru_utime + usage.ru_stime
    return {"tokens": tokens, "job_tok_s": round(tokens / summary["wall_seconds"], 1), "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "cpu_ms_per_token": round(1000 * cpu / tokens, 3),
            "maxrss_mib": round(usage.ru_maxrss / 1024, 1), "other_cores": load.other_cores}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--var", required=True)
    ap.add_argument("--values", required=True, help="two values, comma-separated")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--max-output-len", type=int, default=256)
    args = ap.parse_args()
    values = args.values.split(",")
    from batchgen.engine.model.loader import load_model

    lm = load_model(None, dtype=args.dtype)
    table = build_rows("sharegpt", lm.tokenizer, args)
    del lm
    with tempfile.TemporaryDirectory(prefix="batchgen-env-ab-") as tmp:
        rows = Path(tmp) / "rows.parquet"
        pq.write_table(table, rows)
        for pair in range(args.pairs):
            for value in values if pair % 2 == 0 else values[::-1]:
                rec = run_once(rows, Path(tmp) / f"out-{pair}-{value}", args.dtype, {**os.environ, args.var: value})
                print(json.dumps({"pair": pair, args.var: value, **rec}), flush=True)


if __name__ == "__main__":
    main()
