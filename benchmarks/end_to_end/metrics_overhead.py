"""What monitoring costs: generated tokens/s with metrics files + Prometheus textfile on, against off.

    OMP_NUM_THREADS=1 python -m benchmarks.end_to_end.metrics_overhead                    # embedded SmolLM2-135M
    OMP_NUM_THREADS=1 python -m benchmarks.end_to_end.metrics_overhead --model tiny --rows 2048 --max-new-tokens 16

Both configurations run in this one process on one loaded model, round-robin for --repeats rounds
after an unrecorded warm-up round (the order alternating), each into a fresh output directory.
"on": `_metrics/` streamed and a textfile rewritten every --metrics-every-seconds (1 s by default,
ten times the job default, so the flusher works the hardest it would); "off": --no-metrics and no
textfile. tokens/s = generated tokens / the job's wall seconds (model loading excluded).

On a shared machine the run-to-run noise of wall-clock tokens/s (+-20% on the 2-core machine this
was written on, with 1-2 other cores' worth of load from other processes) is far larger than the
effect, so two steadier figures come with it:

- tokens per CPU-second of this process (all its threads, the flusher included: /proc/self/stat),
  whose ratio on/off is the CPU cost of monitoring per token;
- the seconds spent inside the recorder's callbacks on the job's thread (per engine step, per
  finished row, per commit) as a share of the wall time: what monitoring adds to the hot path
  (measured through a wrapper, so an upper bound);
- the CPU seconds monitoring took in all (those callbacks plus the flusher thread's CPU time:
  segments, textfile) as a share of the process' CPU time: the most tokens/s it can cost on a
  CPU-bound job.

Ratios are per round (the two runs of a round ran back to back) and summarized by their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config.job import build_config
from batchgen.engine.model.loader import load_model
from batchgen.monitor import recorder as recorder_module
from benchmarks.end_to_end.checkpoint_cost import prompts
from benchmarks.sysload import measure


def instrument(spent: list[float], flush_cpu: list[float]) -> None:
    """Wrap the recorder's job-thread callbacks to add their time to spent[0], and its flushes to add
    their thread's CPU time to flush_cpu[0] (the job code is unchanged)."""
    cls = recorder_module.MetricsRecorder
    real_flush = cls.flush

    def timed_flush(self, *args, **kwargs):
        t0 = time.thread_time()
        try:
            return real_flush(self, *args, **kwargs)
        finally:
            flush_cpu[0] += time.thread_time() - t0

    cls.flush = timed_flush
    for name in ("on_step", "on_row", "on_commit"):
        real = getattr(cls, name)

        def timed(self, *args, _real=real, **kwargs):
            t0 = time.perf_counter()
            try:
                return _real(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2), 'tiny', or a path")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--metrics-every-seconds", type=float, default=1.0)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    spent, flush_cpu = [0.0], [0.0]
    instrument(spent, flush_cpu)
    with tempfile.TemporaryDirectory(prefix="batchgen-metrics-") as tmp:
        tmp = Path(tmp)
        if args.model == "tiny":
            from tests.tiny import save_tiny_model_dir

            model_path = save_tiny_model_dir(tmp / "tiny")
        else:
            model_path = None if args.model == "default" else args.model
        loaded = load_model(model_path, device="cpu", dtype=args.dtype)
        src = tmp / "in.parquet"
        pq.write_table(pa.table({"text": prompts(args.rows)}), src)
        configs = {"metrics-off": dict(metrics=False),
                   "metrics-on": dict(metrics=True, metrics_textfile=str(tmp / "job.prom"),
                                      metrics_every_s=args.metrics_every_seconds)}
        from batchgen.jobs.commands.run import run_job

        results: dict[str, list[dict]] = {name: [] for name in configs}
        for round_index in range(-1, args.repeats):  # round -1 warms up and is not kept
            names = list(configs) if round_index % 2 == 0 else list(reversed(configs))
            for name in names:
                out = tmp / f"{name}-{round_index}"
                config = build_config(None, inputs=[str(src)], output=str(out), model=model_path, device="cpu",
                                      dtype=args.dtype, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                      max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                                      quiet=True, commit_every_s=0, **configs[name])
                spent[0] = flush_cpu[0] = 0.0
                with measure() as load:
                    summary = run_job(config, loaded=loaded)
                metrics_dir = out / "_metrics"
                own = load.own_cpu_s
                record = {"tokens_per_s": round(summary.generated_tokens_per_s, 1),
                          "tokens_per_cpu_s": round(summary.num_generated_tokens / own, 1) if own else None,
                          "wall_s": round(summary.wall_seconds, 2), "steps": summary.engine.get("num_steps"),
                          "callback_s": round(spent[0], 4),
                          "callback_share": round(spent[0] / summary.wall_seconds, 5),
                          "flush_cpu_s": round(flush_cpu[0], 4),
                          "monitoring_cpu_share": round((spent[0] + flush_cpu[0]) / own, 5) if own else None,
                          "other_cores": load.to_dict()["other_cores"],
                          "metrics_files": len(list(metrics_dir.glob("*.parquet"))) if metrics_dir.exists() else 0,
                          "other_cpu_s": load.to_dict()["other_cpu_s"]}
                if round_index >= 0:
                    results[name].append(record)
                print(f"round {round_index} {name}: {json.dumps(record)}", flush=True)

    table = {}
    for name, records in results.items():
        rates = [r["tokens_per_s"] for r in records]
        table[name] = {"min": min(rates), "median": statistics.median(rates), "max": max(rates),
                       "callback_share_median": statistics.median(r["callback_share"] for r in records),
                       "monitoring_cpu_share_median": statistics.median(r["monitoring_cpu_share"] or 0
                                                                        for r in records)}
    pairs = list(zip(results["metrics-off"], results["metrics-on"], strict=True))
    wall = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs]
    cpu = [b["tokens_per_cpu_s"] / a["tokens_per_cpu_s"] for a, b in pairs if a["tokens_per_cpu_s"]
           and b["tokens_per_cpu_s"]]
    summary = {"model": loaded.name, "dtype": str(loaded.dtype), "rows": args.rows,
               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
               "metrics_every_s": args.metrics_every_seconds, "tokens_per_s": table,
               "on_vs_off_wall_median": round(statistics.median(wall), 4),
               "on_vs_off_wall_per_round": [round(p, 4) for p in wall],
               "on_vs_off_per_cpu_s_median": round(statistics.median(cpu), 4) if cpu else None,
               "on_vs_off_per_cpu_s_per_round": [round(p, 4) for p in cpu],
               "hot_path_share_median": table["metrics-on"]["callback_share_median"],
               "monitoring_cpu_share_median": table["metrics-on"]["monitoring_cpu_share_median"],
               # the round whose two runs saw the least load from other processes
               "calmest_round": min(range(len(pairs)), key=lambda i: pairs[i][0]["other_cores"] + pairs[i][1][
                   "other_cores"])}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
