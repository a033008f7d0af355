"""Past one process: the same 512-row job through each executor, rows/s and overhead against one process.

    nice -n 19 python -m benchmarks.scale.scale_out                      # local vs 2 shards vs ray (2 actors), 2 rounds
    python -m benchmarks.scale.scale_out --modes local,ray-warm --rounds 3 --json out.json

The job: a tiny random Llama (tests/tiny.py), --rows prompts of 20-80 characters, greedy float32,
--ignore-eos with --max-new-tokens (32), so every mode generates exactly the same tokens. Modes
(MODES, one function each):

- `local`: `python -m batchgen run` in one process (its threads on every core the machine leaves it).
- `ray`: the same command with `--executor ray --ray-actors 2`: a fresh local Ray (all cores), two
  CPU actors (one core each), the driver committing. End to end, Ray's start and the actors'
  imports and model loads included.
- `shards`: `--num-shards 2`, shard 0 and shard 1 as two `batchgen run` processes started together
  (the way Airflow's mapped tasks run on one worker), each with one OpenMP thread so the two share
  the cores without spinning against each other, then `batchgen finalize`. End to end: both
  processes' start-up and model load, and the finalize.
- `ray-warm`: one process that starts Ray (ray.init(num_cpus=2)) and runs an 8-row job first, then
  times `batchgen.ray.run` of the job alone: what a job costs on a cluster that is already up (Ray's
  worker processes are reused; the default executor's Ray Data actor pool is made by the timed job,
  so its actors import and load the model in it).
- `ray-kept`: `ray-warm` with `ray_keep_warm_s` (60 s, `--ray-keep-warm 60`) for both jobs: the
  timed job finds the kept-warm engines of the 8-row one, model loaded, and they fetch the input
  blocks Ray Data read by reference (batchgen.jobs.executors.ray.engines, batchgen.jobs.executors.ray.block_refs).

`--baseline-tree DIR` also runs every mode but local with DIR's batchgen (run from DIR, DIR first
on PYTHONPATH; another git worktree, or `git archive COMMIT | tar -x -C DIR`), named
`<mode>@baseline`, in the same rounds: a before/after of an executor change side by side under the
same load.

Per run: `wall_s` (the command, or the timed call), `job_s` (_summary.json's wall_seconds: the
local executor's streaming and commits, the model loaded before; the Ray driver's whole run),
rows/s = rows / wall_s, `other_cores` the mean cores the rest of the machine kept busy meanwhile
(benchmarks/sysload.py; Ray's own processes are not our waited-for children, so they count there
too: compare it between local runs). Overhead of a mode = its median wall_s / local's median wall_s - 1;
`overhead_job` compares the job seconds the same way. Rounds alternate the modes.
Figures go to stdout as one JSON object (and --json FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.sysload import measure

ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "BATCHGEN_LOG_LEVEL": "WARNING"}
WARM_ROWS = 8
KEEP_WARM_S = 60.0
# the ray-warm/ray-kept child: start Ray, run a short job (workers up), then time the job itself
WARM_CHILD = """
import json, sys, time
import ray
import batchgen.ray
from batchgen.config.job import JobConfig, build_config
args = json.loads(sys.argv[1])
config = args["config"]
if args["keep_warm_s"]:
    if "ray_keep_warm_s" not in JobConfig.field_names():
        sys.exit("this tree's batchgen has no ray_keep_warm_s (--ray-keep-warm)")
    config["ray_keep_warm_s"] = args["keep_warm_s"]
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
batchgen.ray.run(build_config(None, **{**config, "output": args["warm_output"], "max_rows": args["warm_rows"]}),
                 num_actors=2)
t0 = time.monotonic()
summary = batchgen.ray.run(build_config(None, **config), num_actors=2)
print(json.dumps({"wall_s": time.monotonic() - t0, "rows": summary.num_rows}))
ray.shutdown()
"""


def make_job(directory: Path, num_rows: int) -> tuple[Path, Path]:
    from tests.tiny import save_tiny_model_dir

    model_dir = directory / "tiny-llama"
    save_tiny_model_dir(model_dir)
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh ijklmnop") for _ in range(rng.randint(20, 80))) for _ in range(num_rows)]
    src = directory / "in.parquet"
    pq.write_table(pa.table({"id": list(range(num_rows)), "text": texts}), src, row_group_size=128)
    return model_dir, src


def job_settings(model_dir: Path, src: Path, out: Path, max_new_tokens: int) -> dict:
    return {"inputs": [str(src)], "output": str(out), "model": str(model_dir), "id_column": "id", "chat": False,
            "device": "cpu", "dtype": "float32", "max_new_tokens": max_new_tokens, "ignore_eos": True,
            "kv_cache_memory": "64MiB", "quiet": True, "metrics": False}


def cli_args(settings: dict) -> list[str]:
    return ["--input", settings["inputs"][0], "--output", settings["output"], "--model", settings["model"],
            "--id-column", "id", "--no-chat", "--device", "cpu", "--dtype", "float32", "--max-new-tokens",
            str(settings["max_new_tokens"]), "--ignore-eos", "--kv-cache-memory", "64MiB", "--quiet", "--no-metrics"]


def _job_seconds(out: Path) -> float:
    return json.loads((out / "_summary.json").read_text())["wall_seconds"]


def run_cli(settings: dict, extra: list[str]) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "batchgen", "run", *cli_args(settings), *extra],
                          env={**os.environ, **ENV}, capture_output=True, text=True)
    wall_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"wall_s": wall_s, "job_s": _job_seconds(Path(settings["output"]))}


def mode_local(settings: dict) -> dict:
    return run_cli(settings, [])


def mode_ray(settings: dict) -> dict:
    return run_cli(settings, ["--executor", "ray", "--ray-actors", "2"])


def mode_shards(settings: dict, num_shards: int = 2) -> dict:
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "batchgen", "run", *cli_args(settings), "--num-shards",
                               str(num_shards), "--shard-index", str(i)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(num_shards)]
    errors = [p.communicate()[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    done = subprocess.run([sys.executable, "-m", "batchgen", "finalize", "--output", settings["output"]],
                          env={**os.environ, **ENV}, capture_output=True, text=True)
    wall_s = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-2000:]
    out = Path(settings["output"])
    job_s = max(_job_seconds(out / f"shard-{i}-of-{num_shards}") for i in range(num_shards))
    return {"wall_s": wall_s, "job_s": job_s}


def mode_ray_warm(settings: dict, keep_warm_s: float = 0.0) -> dict:
    args = {"config": settings, "warm_output": settings["output"] + "-warmup", "warm_rows": WARM_ROWS,
            "keep_warm_s": keep_warm_s}
    proc = subprocess.run([sys.executable, "-c", WARM_CHILD, json.dumps(args)], env={**os.environ, **ENV},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": record["wall_s"], "job_s": _job_seconds(Path(settings["output"]))}


def mode_ray_kept(settings: dict) -> dict:
    return mode_ray_warm(settings, keep_warm_s=KEEP_WARM_S)


MODES: dict[str, Callable[[dict], dict]] = {"local": mode_local, "shards": mode_shards, "ray": mode_ray,
                                            "ray-warm": mode_ray_warm, "ray-kept": mode_ray_kept}
BASELINE = "@baseline"


def run_mode(mode: str, settings: dict, baseline_tree: Path | None) -> dict:
    """One run of `mode`; a `<mode>@baseline` one with baseline_tree's batchgen: run from that
    directory (`python -m` and `-c` put the working directory first on the path) and first on
    PYTHONPATH (Ray's workers)."""
    if not mode.endswith(BASELINE):
        return MODES[mode](settings)
    saved, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(baseline_tree.resolve()), *([saved] if saved else [])])
    os.chdir(baseline_tree)
    try:
        return MODES[mode.removesuffix(BASELINE)](settings)
    finally:
        os.chdir(cwd)
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--modes", default="local,shards,ray,ray-warm", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--baseline-tree", type=Path,
                        help="also run each mode but local with this tree's batchgen, as <mode>@baseline")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    if "local" not in modes:
        modes.insert(0, "local")  # the baseline
    if args.baseline_tree:
        modes += [m + BASELINE for m in modes if m != "local"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="scale_out-") as tmp:
        directory = Path(tmp)
        model_dir, src = make_job(directory, args.rows)
        for r in range(args.rounds):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # alternate who goes first
                out = directory / f"{mode.replace('@', '-')}-{r}"
                with measure() as load:
                    record = run_mode(mode, job_settings(model_dir, src, out, args.max_new_tokens), args.baseline_tree)
                record["other_cores"] = load.to_dict()["other_cores"]
                record["rows_per_s"] = args.rows / record["wall_s"]
                runs[mode].append(record)
                print(f"round {r} {mode}: {record['wall_s']:.1f} s, job {record['job_s']:.1f} s, "
                      f"{record['rows_per_s']:.1f} rows/s", file=sys.stderr)
    base_wall = statistics.median(x["wall_s"] for x in runs["local"])
    base_job = statistics.median(x["job_s"] for x in runs["local"])
    result = {"rows": args.rows, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "cpu_count": os.cpu_count(), "modes": {}}
    for mode, records in runs.items():
        wall = statistics.median(x["wall_s"] for x in records)
        job = statistics.median(x["job_s"] for x in records)
        result["modes"][mode] = {"wall_s": round(wall, 2), "job_s": round(job, 2),
                                 "rows_per_s": round(args.rows / wall, 2),
                                 "overhead": round(wall / base_wall - 1, 4),
                                 "overhead_job": round(job / base_job - 1, 4), "runs": records}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
