"""Structured output's speed, with and without --jump-forward and beside vLLM-CPU: valid rows per
second, the forward's share of the wall time and decode steps per generated token.

    python -m benchmarks.peers.structured_speed                  # 32 documents, 2 rounds, all systems
    python -m benchmarks.peers.structured_speed --docs 48 --rounds 3 --systems jump-forward,vllm

Two jobs over the same real documents (Python's own pydoc topics, cut to --doc-chars): a 3-field
extraction under a JSON schema, and a 5-way --choices labelling. Each runs as a whole `batchgen run`
process with default flags (the default model) and --jump-forward (the default) or
--no-jump-forward; the four processes of a round run one after another, rounds interleaved. Per
process: valid rows (json_valid for the schema job, a listed label for the choices job) per second
of the whole process and of the job alone (the summary's wall time: start-up apart, as vLLM's),
the summary's forward share (the model's forward over the job's wall time),
decode steps per generated token (the engine's num_row_steps: each step's rows that gained tokens,
over the generated tokens; below 1 where forced tokens ran as drafts) and the forced tokens.

vllm (`benchmarks/peers/vllm_structured_peer.py` in vLLM's venv, ../shared/reference/vllm-cpu-peer.md's
environment): the same chat prompts as token ids, greedy, the same 256-token budget, its
`structured_outputs` (json, or choice) and its dtype at its defaults (--vllm-dtype to pin one);
its valid rows per second are over its `generate` call alone (start-up apart), and its rows pass
the same check as batchgen's (the schema validates the parsed text, the label is listed). Skipped
with a note where its venv is absent. Prints each process, then medians per job and system, and
vLLM's ratio against each.
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

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import DEFAULT_VLLM_PYTHON, load_average, vllm_env

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "keywords", "beginner_friendly"],
          "properties": {"topic": {"type": "string", "maxLength": 40},
                         "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                         "beginner_friendly": {"type": "boolean"}}}
CHOICES = ["syntax", "data model", "standard library", "execution model", "other"]
JOBS = {
    "json-schema": ["--json-schema", json.dumps(SCHEMA), "--template",
                    "Describe this Python documentation as JSON with its topic, up to three keywords and whether "
                    "it is beginner friendly.\n\n{text}"],
    "choices": ["--choices", ",".join(CHOICES), "--template",
                "Which part of Python does this documentation describe: " + ", ".join(CHOICES) + "?\n\n{text}"],
}
MAX_NEW_TOKENS = 256  # batchgen's default, given to vLLM too
SYSTEMS = {"jump-forward": [], "no-jump-forward": ["--no-jump-forward"], "vllm": None}


def valid(job: str, text: str | None, finished: bool) -> bool:
    """One check for every system's rows: the whole answer, and the schema or the label list holds."""
    if not finished or text is None:
        return False
    if job == "choices":
        return text in CHOICES
    try:
        return jsonschema.Draft202012Validator(SCHEMA).is_valid(json.loads(text))
    except json.JSONDecodeError:
        return False


def documents(num_docs: int, doc_chars: int) -> list[str]:
    from pydoc_data.topics import topics

    texts = [text[:doc_chars] for _, text in sorted(topics.items()) if len(text) >= doc_chars]
    assert len(texts) >= num_docs, f"only {len(texts)} topics of {doc_chars} chars"
    return texts[:num_docs]


def run(src: Path, out: Path, job: str, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out), "--id-column", "id",
            "--quiet", *JOBS[job], *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{job} {extra} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "_summary.json").read_text())
    rows = _rows(out)
    num_valid = sum(valid(job, r["generated_text"], r["finish_reason"] == "stop") for r in rows)
    engine = summary["engine"]
    generated = summary["num_generated_tokens"]
    job_s = summary["wall_seconds"]  # the job alone: rows read, generated and committed, start-up apart
    return {"wall_s": wall_s, "rows": len(rows), "valid": num_valid, "valid_rows_per_s": num_valid / wall_s,
            "job_s": job_s, "job_valid_rows_per_s": num_valid / job_s,
            "forward_share": summary.get("forward_share"), "generated": generated,
            "steps_per_token": engine["num_row_steps"] / generated if generated else None,
            "forced": engine.get("num_forced_tokens", 0), "engine_steps": engine["num_steps"],
            "prompt_tokens": summary["num_prompt_tokens"]}


def vllm_rows(texts: list[str], job: str, work: Path) -> tuple[Path, int, str]:
    """(vLLM's rows file: batchgen's chat prompt of each document as token ids, its max_model_len,
    the model directory both systems load)."""
    from batchgen.engine.model.loader import load_tokenizer

    tokenizer, _ = load_tokenizer(None)
    template = JOBS[job][JOBS[job].index("--template") + 1]
    ids = []
    for text in texts:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": template.replace("{text}", text)}],
                                             add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    rows = work / f"vllm-{job}.parquet"
    pq.write_table(pa.table({"prompt_token_ids": ids, "max_new_tokens": [MAX_NEW_TOKENS] * len(ids)}), rows)
    max_len = -(-(max(map(len, ids)) + MAX_NEW_TOKENS) // 256) * 256
    return rows, max_len, tokenizer.name_or_path


def run_vllm(python: Path, work: Path, job: str, rows: tuple[Path, int, str], name: str, dtype: str) -> dict:
    spec = work / f"{job}-spec.json"
    spec.write_text(json.dumps(SCHEMA if job == "json-schema" else CHOICES))
    texts_out = work / f"{name}-texts.json"
    argv = [str(python), str(Path(__file__).with_name("vllm_structured_peer.py")), "--model", rows[2],
            "--rows", str(rows[0]), "--max-model-len", str(rows[1]), "--texts-out", str(texts_out), "--dtype", dtype,
            "--json-schema" if job == "json-schema" else "--choices", str(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=vllm_env(python))
    process_s = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"vllm {job} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    r = json.loads(lines[-1])
    outputs = json.loads(texts_out.read_text())
    num_valid = sum(valid(job, o["text"], o["finish_reason"] == "stop") for o in outputs)
    return {"wall_s": r["generate_s"], "process_s": process_s, "startup_s": r["startup_s"], "rows": len(outputs),
            "valid": num_valid, "valid_rows_per_s": num_valid / r["generate_s"], "job_s": None,
            "job_valid_rows_per_s": None, "forward_share": None,
            "generated": r["generated_tokens"], "steps_per_token": None, "forced": 0, "engine_steps": None,
            "prompt_tokens": r["prompt_tokens"]}


def _rows(out: Path) -> list[dict]:
    parts = sorted(p for p in out.rglob("part-*.parquet"))
    return [row for p in parts for row in pq.read_table(p).to_pylist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--doc-chars", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--vllm-dtype", default="auto", help="auto: vLLM's default, as batchgen runs at its own")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="batchgen-structured-speed-"))
    texts = documents(args.docs, args.doc_chars)
    src = work / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), src)
    systems = args.systems.split(",")
    if "vllm" in systems and not args.vllm_python.exists():
        print(f"NOTE: vllm skipped: no vLLM venv at {args.vllm_python} (recipe: ../shared/reference/vllm-cpu-peer.md)")
        systems.remove("vllm")
    jobs = args.jobs.split(",")
    peer_rows = {job: vllm_rows(texts, job, work) for job in jobs} if "vllm" in systems else {}
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for job in jobs:
            for name in systems[r % len(systems):] + systems[:r % len(systems)]:  # the first rotates each round
                if name == "vllm":
                    m = run_vllm(args.vllm_python, work, job, peer_rows[job], f"{r}-{job}", args.vllm_dtype)
                else:
                    m = run(src, work / f"out-{r}-{job}-{name}", job, SYSTEMS[name])
                results.setdefault((job, name), []).append(m)
                print(f"round {r} {line(job, name, m)}  {load_average()}", flush=True)
    print(f"\n{args.docs} documents (pydoc topics, {args.doc_chars} chars), default flags; batchgen whole process, "
          f"vLLM its generate call; medians of {args.rounds} rounds")
    medians = {}
    for (job, name), ms in results.items():
        medians[job, name] = {key: statistics.median(m[key] for m in ms if m[key] is not None)
                              if any(m[key] is not None for m in ms) else None for key in ms[0]}
        medians[job, name]["valid"] = min(m["valid"] for m in ms)
        print(f"  {line(job, name, medians[job, name])}")
    for job in jobs:
        if (job, "vllm") in medians:
            peer = medians[job, "vllm"]["valid_rows_per_s"]
            for name in systems:
                if name != "vllm":
                    ratio = medians[job, name]["valid_rows_per_s"] / peer if peer else float("inf")
                    job_ratio = medians[job, name]["job_valid_rows_per_s"] / peer if peer else float("inf")
                    print(f"  {job:12s} {name:16s} {ratio:.2f}x vLLM-CPU's valid rows/s (batchgen whole process); "
                          f"{job_ratio:.2f}x (batchgen's job alone, as vLLM's generate call)")


def line(job: str, name: str, m: dict) -> str:
    text = (f"{job:12s} {name:16s} {m['wall_s']:6.1f} s  valid {m['valid']}/{m['rows']}  "
            f"{m['valid_rows_per_s']:.3f} valid rows/s  generated {m['generated']}  prompt {m['prompt_tokens']}")
    if name == "vllm":
        return text + f"  (start-up {m['startup_s']:.1f} s, process {m['process_s']:.1f} s)"
    return text + (f"  job {m['job_s']:.1f} s ({m['job_valid_rows_per_s']:.3f} valid rows/s)"
                   f"  forward {100 * m['forward_share']:.1f}%  steps/token {m['steps_per_token']:.3f}  "
                   f"forced {m['forced']}  engine steps {m['engine_steps']}")


if __name__ == "__main__":
    main()
