"""int4 recipes compared on the embedded model: weight bytes and teacher-forced agreement with bf16.

The prompts, bf16 greedy outputs and scoring are benchmarks/quant/quality.py's (top-1 agreement and mean
KL, teacher-forced); instead of `--quantize` schemes, each recipe picks per decoder linear layer a
torchao int4 group size and qparams algorithm ("tinygemm": min/max, "hqq"), or int8 weight-only,
and the embedding/LM head is int8 (the int4 default). Used to choose engine/quant/recipe.py.

    nice -n 19 python -m benchmarks.quant.int4_recipes --docs 4 --n 12 --max-new-tokens 32 --recipes g64,g32,g32+gate64
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch

from batchgen.engine.model.loader import load_model
from batchgen.engine.quant.embedding import quantize_embeddings
from batchgen.engine.quant.quantize import weight_bytes
from benchmarks.quant import quality


def _int4(group: int, algo: str = "tinygemm"):
    return lambda name: ("int4", group, algo)


def _mixed(default, **by_child):
    return lambda name: by_child.get(name.rsplit(".", 1)[-1], default(name))


RECIPES = {
    "g64": _int4(64), "g32": _int4(32), "g64-hqq": _int4(64, "hqq"), "g32-hqq": _int4(32, "hqq"),
    "g32+gate64": _mixed(_int4(32), gate_proj=("int4", 64, "tinygemm")),
    "g32+up64": _mixed(_int4(32), up_proj=("int4", 64, "tinygemm")),
    "g32+down64": _mixed(_int4(32), down_proj=("int4", 64, "tinygemm")),
    "g64+down-int8": _mixed(_int4(64), down_proj=("int8-weight",)),
}


def apply(model: torch.nn.Module, recipe) -> None:
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    head = model.get_output_embeddings()
    groups: dict[tuple, set[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            groups.setdefault(recipe(name), set()).add(name)
    for spec, names in groups.items():
        if spec[0] == "int4":
            config = PrototypeInt4WeightOnlyConfig(group_size=spec[1], int4_choose_qparams_algorithm=spec[2])
        else:
            config = Int8WeightOnlyConfig()
        config.set_inductor_config = False
        quantize_(model, config, filter_fn=lambda module, fqn, names=names: fqn in names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--n", type=int, default=12, help="ShareGPT prompts")
    ap.add_argument("--doc-chars", type=int, default=1500)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--recipes", default="g64,g32,g32+gate64", help=f"comma-separated, of {', '.join(RECIPES)}")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    base = load_model(None, device="cpu", dtype="bfloat16")
    bf16_bytes = weight_bytes(base.model)
    sets = quality.prompts(base.tokenizer, args.docs, args.n, args.doc_chars)
    ref_out = quality.greedy(base, sets, args.max_new_tokens, "auto")
    seqs = {name: list(zip(sets[name], ref_out[name], strict=True)) for name in sets}
    ref_lp = {name: quality.teacher_forced(base.model, s) for name, s in seqs.items()}
    del base
    for label in args.recipes.split(","):
        t0 = time.time()
        lm = load_model(None, device="cpu", dtype="bfloat16")
        apply(lm.model, RECIPES[label])
        quantize_embeddings(lm.model)
        nbytes = weight_bytes(lm.model)
        scores = []
        for name, s in seqs.items():
            lp = quality.teacher_forced(lm.model, s)
            agree = sum(int((q.argmax(-1) == torch.tensor(g)).sum()) for q, (_, g) in zip(lp, s, strict=True))
            total = sum(len(g) for _, g in s)
            kl = sum(float((r.exp() * (r - q)).sum()) for r, q in zip(ref_lp[name], lp, strict=True)) / total
            scores.append(f"{name}: top1 {agree / total:.3f} KL {kl:.4f}")
        print(f"{label:16s} {nbytes / 1e6:6.1f} MB ({nbytes / bf16_bytes:.3f}x bf16)  " + "  ".join(scores)
              + f"  [{time.time() - t0:.0f} s]", flush=True)
        del lm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
