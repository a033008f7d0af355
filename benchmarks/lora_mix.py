"""Rows spread over four LoRA adapters in one job against the same rows on the base model alone.

    python -m benchmarks.lora_mix                    # 48 rows, 64 new tokens each, 2 rounds
    python -m benchmarks.lora_mix --rows 96 --rounds 3

The adapters are made once with peft on the embedded default model (its weights dequantized to
float32, as PEFT trains on them): ranks 8, 8, 16 and 16 on every attention and MLP projection,
A and B both random (PEFT's zero B would leave the output unchanged), saved as PEFT saves them.
Two whole `batchgen run` processes per round, interleaved, default flags but --max-new-tokens and
--ignore-eos (every row generates the same number of tokens, so the two jobs do the same work):
the base-only job (no --lora), and the mixed job (--lora x4, --lora-column, rows i % 5: one of
the four adapters or the base model, so each adapter and the base get a fifth of the rows).
Prints each process's wall time and tokens/s, the medians, and the mixed job's ratio to the
base-only job (the goal: >= 0.7x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

RANKS = (8, 8, 16, 16)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(root: Path) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model

    from batchgen.engine.model.loader import load_model

    loaded = load_model(None, device="cpu", dtype="float32", quantize="none")
    dirs = {}
    for i, rank in enumerate(RANKS):
        torch.manual_seed(i)
        model = get_peft_model(loaded.model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                        init_lora_weights=False), adapter_name=f"a{i}")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        path = root / f"a{i}"
        model.save_pretrained(str(path))
        dirs[f"a{i}"] = str(path / f"a{i}") if (path / f"a{i}").is_dir() else str(path)
        loaded.model = model.unload()  # the base model again, without this adapter's layers
    return dirs


def documents(num_rows: int, doc_chars: int) -> list[str]:
    from pydoc_data.topics import topics

    texts = [text[:doc_chars] for _, text in sorted(topics.items()) if len(text) >= doc_chars // 2]
    return [texts[i % len(texts)] for i in range(num_rows)]


def run(src: Path, out: Path, extra: list[str], max_new_tokens: int) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out), "--id-column", "id",
            "--template", "Summarize in one sentence:\n\n{text}", "--max-new-tokens", str(max_new_tokens),
            "--ignore-eos", "--quiet", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall_s, json.loads((out / "_summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--doc-chars", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="batchgen-lora-mix-"))
    dirs = make_adapters(work / "adapters")
    names = [*dirs, None]  # the base model too, among the mixed job's rows
    texts = documents(args.rows, args.doc_chars)
    src = work / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(args.rows)), "text": texts,
                             "adapter": [names[i % len(names)] for i in range(args.rows)]}), src)
    lora = [arg for name, path in dirs.items() for arg in ("--lora", f"{name}={path}")]
    jobs = {"base only": [], "mixed (4 adapters + base)": [*lora, "--lora-column", "adapter"]}
    rates: dict[str, list[float]] = {name: [] for name in jobs}
    for r in range(args.rounds):
        for k, (name, extra) in enumerate(jobs.items()):
            wall_s, summary = run(src, work / f"out-{r}-{k}", extra, args.max_new_tokens)
            tokens = summary["num_generated_tokens"]
            rates[name].append(tokens / wall_s)
            print(f"round {r} {name:28s} {wall_s:7.1f} s  {tokens} tokens  {tokens / wall_s:7.1f} tokens/s  "
                  f"errors {summary['num_rows_error']}", flush=True)
    base = statistics.median(rates["base only"])
    print(f"\n{args.rows} rows (<= {args.doc_chars} chars), --max-new-tokens {args.max_new_tokens} --ignore-eos; "
          f"adapters of ranks {', '.join(map(str, RANKS))} on {', '.join(TARGETS)}; medians of {args.rounds} rounds, "
          "whole process")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:28s} median {median:7.1f} tokens/s  {median / base:.2f}x base only")


if __name__ == "__main__":
    main()
