"""The embedded model's weights with a sliding window, as a model directory both batchgen and vLLM load.

    python -m benchmarks.tools.window_model --family mistral --window 256 --out /tmp/smollm2-mistral-w256
    python -m benchmarks.tools.window_model --family qwen2 --window 256 --global-every 6 --out /tmp/smollm2-qwen2-lg

No sliding-window checkpoint ships in the registries this project may reach, so the speed and memory
comparisons of windowed attention run SmolLM2-135M's real weights under an architecture whose math is
Llama's plus a window:

  mistral  every layer attends a `--window`-token window (Mistral 7B v0.1's shape): Llama's modules
           exactly, so the weights load unchanged
  qwen2    local/global (Gemma 3's and gpt-oss's shape): every `--global-every`-th layer full
           attention, the others windowed, written as Qwen2's `layer_types`; Qwen2's q/k/v projections
           carry biases, stored as zeros, so the math stays Llama's

The text such a model writes is not SmolLM2's (its layers were not trained with a window), which does
not matter to a benchmark that fixes every row's output length; the weights' scale and the shapes are
real, so the step times are those of a real 135M model.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def embedded_model_dir() -> Path:
    """The embedded model's converted safetensors directory (converting it once if needed)."""
    from batchgen.engine.model.loader import load_model

    lm = load_model(None, dtype="float32")
    return Path(lm.model.name_or_path)


def window_config(config: dict, family: str, window: int, global_every: int) -> dict:
    config = dict(config)
    config["sliding_window"] = window
    if family == "mistral":
        config.update(model_type="mistral", architectures=["MistralForCausalLM"])
        return config
    num_layers = config["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % global_every == 0 else "sliding_attention"
                   for i in range(num_layers)]
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                  max_window_layers=0, layer_types=layer_types)
    config.pop("attention_bias", None)
    config.pop("mlp_bias", None)
    return config


def build(source: Path, out: Path, family: str, window: int, global_every: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(window_config(config, family, window, global_every), indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)
    if family == "mistral":
        shutil.copy2(source / "model.safetensors", out / "model.safetensors")
        return out
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        weight = tensors[name]
        tensors[name.removesuffix("weight") + "bias"] = weight.new_zeros(weight.shape[0])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("mistral", "qwen2"), default="mistral")
    ap.add_argument("--window", type=int, default=256, help="tokens each windowed layer's queries see")
    ap.add_argument("--global-every", type=int, default=6, help="qwen2: every N-th layer is full attention")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(build(embedded_model_dir(), args.out, args.family, args.window, args.global_every))


if __name__ == "__main__":
    main()
