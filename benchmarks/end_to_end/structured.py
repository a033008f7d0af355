"""Structured output: constrained vs unconstrained tokens/s on the same rows, and grammar compile time.

    python -m benchmarks.end_to_end.structured                       # 32 docs, 64 tokens, 3 rounds, the embedded model
    python -m benchmarks.end_to_end.structured --num-docs 8 --repeats 1

Rows: the first --num-docs documents of examples/docs.parquet, each asked (chat template) to
describe itself as JSON; prompts cut to --max-prompt-tokens. Systems, greedy, one engine each run:
  unconstrained   no constraint, EOS or --max-new-tokens ends a row
  json-schema     the same rows under a small JSON schema (the grammar ends a row)
  choices         the same rows under a 5-way choice (labelling)
  json-schema-serial  json-schema with the next step's masks filled after the forward instead of
                  beside it (engine/sampling/mask_prefetch.py): the overlap's before and after
Tokens/s = generated tokens / wall seconds of the generate call (engine construction excluded).
Constrained rows stop when their grammar does, so they generate fewer tokens than free rows and the
prompts' prefill weighs more in their tokens/s: grammar_share (the seconds spent in the grammar's
mask and accept calls on the engine's thread over the wall seconds; the masks filled beside the
forward count only where the engine waits for them, background_s is the worker's own time) is the
like-for-like cost of the constraint. Each line names its system and the constraint's kind and text,
so a peer run with the same schema (`--print-schema` prints it) can be set beside it. The
systems run round-robin in one process, the start rotating each round, each run with the CPU
seconds other processes took meanwhile (sysload). Compile time: the tokenizer's one-off setup for
the grammar engine, then each schema's compile on that tokenizer (median of 5, a fresh cache each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pyarrow.parquet as pq
import torch

from batchgen.config.constraint import Constraint, ConstraintKind
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.loader import load_model
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.sampling.grammar import GrammarMasks
from benchmarks import sysload
from benchmarks.common import EXAMPLE_DOCS

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "keywords", "beginner_friendly"],
          "properties": {"topic": {"type": "string", "maxLength": 40},
                         "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                         "beginner_friendly": {"type": "boolean"}}}
BIG_SCHEMA = {"type": "object", "required": ["id", "tags", "owner", "items"], "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "tags": {"type": "array", "items": {"enum": [
        "a", "b", "c"]}},
    "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string",
                                                                                       "format": "email"}}},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty"]}}}}
CHOICES = ["syntax", "data model", "standard library", "execution model", "other"]
SYSTEMS = {"unconstrained": None, "json-schema": Constraint.json_schema(SCHEMA), "choices": Constraint.choices(CHOICES),
           "json-schema-serial": Constraint.json_schema(SCHEMA)}
SERIAL = {"json-schema-serial"}  # systems whose masks are filled after the forward


def prompts(tokenizer, num_docs: int, max_prompt_tokens: int) -> list[list[int]]:
    texts = pq.read_table(EXAMPLE_DOCS, columns=["text"]).column("text").to_pylist()[:num_docs]
    out = []
    for text in texts:
        body = tokenizer(text, add_special_tokens=False)["input_ids"][:max_prompt_tokens]
        message = ("Describe this Python documentation as JSON with topic, keywords and beginner_friendly.\n\n"
                   + tokenizer.decode(body))
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    return out


def run_once(loaded, ids: list[list[int]], constraint: Constraint | None, max_new_tokens: int, *,
             overlap: bool = True) -> dict:
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(adaptive_threads=False),
                       eos_token_ids=loaded.eos_token_ids)
    engine.grammar.overlap = overlap
    grammar_s = _time_grammar(engine.grammar)
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=max_new_tokens, constraint=constraint))
                for i, p in enumerate(ids)]
    steps = [0]

    def count() -> None:
        steps[0] += 1

    with sysload.measure() as load:
        t0 = time.perf_counter()
        done = list(engine.generate(requests, between_steps=count))
        wall_s = time.perf_counter() - t0
    tokens = sum(c.num_generated_tokens for c in done)
    valid = sum(_valid(constraint, c.text) for c in done) if constraint is not None else None
    return {"wall_s": wall_s, "tokens": tokens, "tokens_per_s": tokens / wall_s, "steps": steps[0],
            "ms_per_step": 1000 * wall_s / steps[0], "grammar_s": grammar_s[0],
            "grammar_share": grammar_s[0] / wall_s, "background_s": engine.grammar.background_s,
            "prefetched_rows": engine.grammar.num_prefetched_rows, "filled_rows": engine.grammar.num_filled_rows,
            "valid_rows": valid,
            "rows": len(done), "other_cores": load.other_cores, "sample": done[0].text[:120]}


def _time_grammar(masks: GrammarMasks) -> list[float]:
    """Wrap the engine's mask and accept calls: the seconds the constraint added to the steps."""
    total = [0.0]
    for name in ("mask", "accept"):
        inner = getattr(masks, name)

        def timed(*args, _inner=inner):
            t = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                total[0] += time.perf_counter() - t
        setattr(masks, name, timed)
    return total


def _valid(constraint: Constraint, text: str) -> bool:
    if constraint.is_json:
        try:
            json.loads(text)
            return True
        except json.JSONDecodeError:
            return False
    return text in CHOICES


def compile_times(tokenizer, vocab_size: int) -> dict:
    t0 = time.perf_counter()
    masks = GrammarMasks(tokenizer, vocab_size)
    masks._tokenizer()  # the one-off setup, timed apart
    setup_s = time.perf_counter() - t0
    out = {"tokenizer_setup_s": round(setup_s, 3)}
    for name, constraint in (("small-schema", Constraint.json_schema(SCHEMA)),
                             ("order-schema", Constraint.json_schema(BIG_SCHEMA)),
                             ("choices", Constraint.choices(CHOICES)), ("regex", Constraint.regex(r"[A-Z]{3}-\d{4}"))):
        times = []
        for _ in range(5):
            masks._compiled.clear()
            t = time.perf_counter()
            masks.compiled(constraint)
            times.append(time.perf_counter() - t)
        out[f"{name}_compile_ms"] = round(1000 * statistics.median(times), 2)
    return out


def _constraint_fields(constraint: Constraint | None) -> dict:
    """The constraint a line was measured under, as a peer's run would be given it."""
    if constraint is None:
        return {"constraint": None}
    spec = constraint.spec if constraint.kind is ConstraintKind.REGEX else json.loads(constraint.spec or "null")
    return {"constraint": constraint.kind.value, "spec": spec}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-docs", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS))
    parser.add_argument("--print-schema", action="store_true", help="print the JSON schema and choices, and exit")
    args = parser.parse_args()
    if args.print_schema:
        print(json.dumps({"json_schema": SCHEMA, "choices": CHOICES}))
        return
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown or "unconstrained" not in names:
        parser.error(f"--systems: unknown {unknown}" if unknown else "--systems must include unconstrained")
    loaded = load_model(None, device="cpu", dtype=args.dtype)
    ids = prompts(loaded.tokenizer, args.num_docs, args.max_prompt_tokens)
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    print(json.dumps({"compile": compile_times(loaded.tokenizer, vocab), "threads": torch.get_num_threads()}))
    results: dict[str, list[dict]] = {n: [] for n in names}
    for round_index in range(args.repeats):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            result = run_once(loaded, ids, SYSTEMS[name], args.max_new_tokens, overlap=name not in SERIAL)
            results[name].append(result)
            print(json.dumps({"system": name, "round": round_index, **_constraint_fields(SYSTEMS[name]),
                              **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()}}))
    base = statistics.median(r["tokens_per_s"] for r in results["unconstrained"])
    for name in names:
        rates = [r["tokens_per_s"] for r in results[name]]
        print(json.dumps({"summary": name, **_constraint_fields(SYSTEMS[name]),
                          "tokens_per_s_min": round(min(rates), 1),
                          "wall_s_median": round(statistics.median(r["wall_s"] for r in results[name]), 2),
                          "grammar_share_median": round(statistics.median(
                              r["grammar_share"] for r in results[name]), 4),
                          "tokens_per_s_median": round(statistics.median(rates), 1),
                          "ms_per_step_median": round(statistics.median(r["ms_per_step"] for r in results[name]), 1),
                          "vs_unconstrained_median": round(statistics.median(rates) / base, 3)}))


if __name__ == "__main__":
    main()
