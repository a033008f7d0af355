"""The sampled draw alone, on logits captured from a real job: the CPU kernel against the window path.

    python -m benchmarks.kernels.draw_replay --n 64 --max-output-len 64 --repeats 7

Runs a sampled job (temperature 0.8, top-p 0.95, ignore-EOS) on the embedded model over ShareGPT
rows, in this process, and keeps the logits and row settings of every `--every`-th decode step.
Then replays those steps through engine/sampling/draw.py three ways, under several settings:

    kernel          the whole draw in one C call (csrc/sample_draw.c), what a CPU step runs
    window-kernel   the window path with its first window from csrc/sample_window.c (logprobs' path)
    window-torch    the window path in torch ops (other devices' path)

and prints the milliseconds per step (best of `--repeats` passes) and whether the three drew the
same tokens. The forward is not in these figures: they are what sampling adds to a step.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from benchmarks.peers.generate import build_rows

SETTINGS = {
    "top-p 0.95": dict(top_p=0.95),
    "temperature only": dict(top_p=1.0),
    "temperature 1.0 only": dict(top_p=1.0, temperature=1.0),
    "top-k 50": dict(top_p=1.0, top_k=50),
    "min-p 0.05": dict(top_p=1.0, min_p=0.05),
}


def capture(n: int, max_output_len: int, every: int, tmp: Path) -> list[tuple[torch.Tensor, object]]:
    import batchgen.engine.sampling.sampler as sampler_module
    from batchgen.cli import main as cli
    from batchgen.engine.model.loader import load_model

    lm = load_model(None, dtype="bfloat16")
    rows = tmp / "rows.parquet"
    pq.write_table(build_rows("sharegpt", lm.tokenizer, argparse.Namespace(n=n, max_output_len=max_output_len)), rows)
    del lm
    steps: list[tuple[torch.Tensor, object]] = []
    draw = sampler_module.draw
    seen = [0]

    def keep(logits, controls, window, **kw):
        seen[0] += 1
        if seen[0] % every == 0:
            steps.append((logits.clone(), copy.copy(controls)))
        return draw(logits, controls, window, **kw)

    sampler_module.draw = keep
    sys.argv = ["batchgen", "run", "--input", str(rows), "--output", str(tmp / "out"), "--dtype", "bfloat16",
                "--no-chat", "--ignore-eos", "--max-new-tokens-column", "max_new_tokens", "--id-column", "id",
                "--quiet", "--temperature", "0.8", "--top-p", "0.95"]
    try:
        cli()
    except SystemExit as e:
        if e.code:
            raise
    finally:
        sampler_module.draw = draw
    return steps


def with_settings(controls, settings: dict):
    c = copy.copy(controls)
    rows = c.temperature.shape[0]
    if "temperature" in settings:
        c.temperature = torch.full((rows,), settings["temperature"])
    c.top_p = torch.full((rows,), settings.get("top_p", 1.0))
    c.top_k = torch.full((rows,), settings.get("top_k", 0), dtype=torch.long)
    c.min_p = torch.full((rows,), settings.get("min_p", 0.0))
    c.any_top_p, c.max_top_k, c.any_min_p = bool((c.top_p < 1).any()), int(c.top_k.max()), bool((c.min_p > 0).any())
    return c


def replay(steps, window: int, repeats: int, path: str) -> tuple[float, list[torch.Tensor]]:
    from batchgen.engine.sampling import draw as draw_module

    saved = draw_module.sample_draw, draw_module.sample_window
    if path != "kernel":
        draw_module.sample_draw = lambda *args: None
    if path == "window-torch":
        draw_module.sample_window = lambda *args: None
    try:
        tokens = [draw_module.draw(logits, c, window).token_ids for logits, c in steps]
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for logits, c in steps:
                draw_module.draw(logits, c, window)
            best = min(best, time.perf_counter() - started)
    finally:
        draw_module.sample_draw, draw_module.sample_window = saved
    return 1000 * best / len(steps), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64, help="ShareGPT rows")
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--every", type=int, default=4, help="keep every k-th decode step")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    from batchgen.engine.sampling.sampler import DEFAULT_WINDOW

    with tempfile.TemporaryDirectory(prefix="batchgen-draw-") as tmp:
        steps = capture(args.n, args.max_output_len, args.every, Path(tmp))
    rows = sum(logits.shape[0] for logits, _ in steps)
    print(f"{len(steps)} steps captured ({rows} rows, vocab {steps[0][0].shape[1]}, {steps[0][0].dtype}), "
          f"{torch.get_num_threads()} threads")
    results = {}
    print("\n| settings | kernel ms/step | window-kernel | window-torch | kernel speedup | same tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for name, settings in SETTINGS.items():
        these = [(logits, with_settings(c, settings)) for logits, c in steps]
        timed = {path: replay(these, DEFAULT_WINDOW, args.repeats, path)
                 for path in ("kernel", "window-kernel", "window-torch")}
        same = all(torch.equal(a, b) for path in ("window-kernel", "window-torch")
                   for a, b in zip(timed["kernel"][1], timed[path][1], strict=True))
        ms = {path: t for path, (t, _) in timed.items()}
        results[name] = {**ms, "same_tokens": same}
        print(f"| {name} | {ms['kernel']:.2f} | {ms['window-kernel']:.2f} | {ms['window-torch']:.2f} | "
              f"{ms['window-kernel'] / ms['kernel']:.2f}x | {'yes' if same else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"steps": len(steps), "rows": rows, "results": results}, indent=1))


if __name__ == "__main__":
    main()
