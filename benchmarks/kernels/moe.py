"""Mixture-of-experts speed through the engine: tokens/s and the experts' share of the step time,
per experts implementation, on a random-weight MoE model of a realistic small shape.

    python -m benchmarks.kernels.moe --dtype bfloat16,float32 --requests 32 --prompt-len 128 --output-len 64
    OMP_NUM_THREADS=1 python -m benchmarks.kernels.moe --threads 1 --repeats 3

The model is an OLMoE-shaped decoder scaled down (`--hidden`, `--moe-intermediate`, `--experts`,
`--top-k`, `--layers`; 32k vocabulary), random weights, built from its config: nothing is
downloaded. Each run is `--requests` random prompts of `--prompt-len` tokens, `--output-len`
greedy tokens with ignore-EOS, through one LLMEngine (continuous policy, no prefix caching, a KV
cache for every row at once; oneDNN's kernel caches capped as `batchgen run` caps them). Systems,
run round-robin per round, the start rotating:
  eager             transformers' per-expert loop (one-hot mask, `where`, a matmul per hit expert)
  grouped_mm        transformers' grouped pass (`torch.nn.functional.grouped_mm`): what
                    `from_pretrained` picks by default, so what the engine ran before
  batchgen_grouped  the engine's default on the CPU in bf16 (engine/model/experts.py): the same
                    sort by expert, each hit expert's matmuls on weights reordered once for oneDNN;
                    here in float32 too (the engine keeps grouped_mm there), to compare
  dense             a Llama of the same shape whose MLP has the MoE's active width (top-k x the
                    expert width): the same active parameters per token, no routing
The engine is built once per model and dtype; the systems switch with `set_experts_implementation`.

Figures: `tok/s` generated tokens per second of wall time (median over rounds, min-max beside);
`experts %` the share of that wall time inside the expert modules' forward (forward hooks, wall
time), `moe block %` inside the whole sparse block (router and experts); `other cores` the CPU
other processes took meanwhile (benchmarks/sysload.py): near 0 is a clean run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OlmoeConfig

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model import experts
from batchgen.engine.request import Request, SamplingParams
from batchgen.runtime import onednn_cache
from benchmarks import sysload
from benchmarks.common import RESULTS_DIR
from tests.tiny import make_tokenizer

IMPLEMENTATIONS = ("eager", "grouped_mm", experts.EXPERTS_IMPLEMENTATION)
VOCAB_SIZE = 32000


def model_config(args, dense: bool):
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=4096,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if dense:
        return LlamaConfig(intermediate_size=args.top_k * args.moe_intermediate, **common)
    return OlmoeConfig(intermediate_size=args.moe_intermediate, num_experts=args.experts,
                       num_experts_per_tok=args.top_k, **common)


def build(args, dense: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(args, dense), attn_implementation="sdpa",
                                            dtype=dtype).eval()


class BlockTimer:
    """Wall seconds spent inside the forward of the given modules (outermost calls only)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.seconds = 0.0
        self._start: dict[int, float] = {}
        self.handles = []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._start[id(module)] = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._start.pop(id(module))


def workload(args, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(str(i), [rng.randrange(5, VOCAB_SIZE) for _ in range(args.prompt_len)],
                    SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)) for i in range(args.requests)]


def make_engine(model, args) -> LLMEngine:
    blocks_per_seq = -(-(args.prompt_len + args.output_len) // 16) + 1
    return LLMEngine(model, make_tokenizer(), EngineConfig(
        max_num_seqs=args.requests, block_size=16, num_kv_blocks=blocks_per_seq * args.requests,
        enable_prefix_caching=False, adaptive_threads=False), eos_token_ids=[])


def run_once(engine: LLMEngine, impl: str, args, seed: int) -> dict:
    model = engine.model
    if impl != "dense":
        model.set_experts_implementation(impl)
    expert_modules = experts.expert_modules(model)
    blocks = [m for m in model.modules() if any(c in expert_modules for c in m.children())]
    expert_timer, block_timer = BlockTimer(expert_modules), BlockTimer(blocks)
    requests = workload(args, seed)
    with sysload.measure() as load:
        completions = list(engine.generate(requests))
    for h in expert_timer.handles + block_timer.handles:
        h.remove()
    tokens = sum(len(c.token_ids) for c in completions)
    return {"tok_s": tokens / load.wall_s, "experts_share": expert_timer.seconds / load.wall_s,
            "block_share": block_timer.seconds / load.wall_s, "wall_s": load.wall_s,
            "other_cores": load.other_cores, "tokens": {c.request_id: c.token_ids[:8] for c in completions}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16,float32")
    p.add_argument("--systems", default=",".join((*IMPLEMENTATIONS, "dense")))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "moe.json")
    args = p.parse_args()
    onednn_cache.apply_defaults()  # the kernel caches `batchgen run` runs with, before the first forward
    experts.GROUPED_DTYPES = (torch.bfloat16, torch.float32)  # the candidate in every dtype measured
    if args.threads:
        torch.set_num_threads(args.threads)
    systems = args.systems.split(",")
    report = {"args": vars(args) | {"out": str(args.out)}, "threads": torch.get_num_threads(), "results": {}}
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        engines = {}
        if any(s != "dense" for s in systems):
            engines["moe"] = make_engine(build(args, False, dtype), args)
        if "dense" in systems:
            engines["dense"] = make_engine(build(args, True, dtype), args)
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for r in range(args.repeats):
            for i in range(len(systems)):
                system = systems[(i + r) % len(systems)]
                engine = engines["dense" if system == "dense" else "moe"]
                runs[system].append(run_once(engine, system, args, seed=r))
                print(f"{dtype_name} round {r} {system}: {runs[system][-1]['tok_s']:.1f} tok/s, experts "
                      f"{100 * runs[system][-1]['experts_share']:.0f}%, other cores "
                      f"{runs[system][-1]['other_cores']}", flush=True)
        # every MoE system generates the same greedy tokens in float32 (rounding may differ in bf16)
        first = {s: runs[s][0]["tokens"] for s in systems if s != "dense"}
        report["results"][dtype_name] = {
            s: {"tok_s_median": statistics.median(x["tok_s"] for x in rs), "tok_s_min": min(x["tok_s"] for x in rs),
                "tok_s_max": max(x["tok_s"] for x in rs),
                "experts_share_median": statistics.median(x["experts_share"] for x in rs),
                "block_share_median": statistics.median(x["block_share"] for x in rs),
                "other_cores": [x["other_cores"] for x in rs],
                "same_first_tokens_as_eager": (first.get(s) == first.get("eager")) if s in first else None}
            for s, rs in runs.items()}
    print(f"\n{'dtype':9} {'system':17} {'tok/s':>8} {'min-max':>14} {'experts %':>10} {'moe block %':>12} other cores")
    for dtype_name, rows in report["results"].items():
        for s, v in rows.items():
            print(f"{dtype_name:9} {s:17} {v['tok_s_median']:8.1f} {v['tok_s_min']:6.1f}-{v['tok_s_max']:<7.1f} "
                  f"{100 * v['experts_share_median']:10.0f} {100 * v['block_share_median']:12.0f} {v['other_cores']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
