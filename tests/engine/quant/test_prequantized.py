"""Pre-quantized checkpoints through `batchgen run --model DIR`: a model directory whose config.json
carries a quantization_config loads as transformers quantizes it and runs under our forward.

torchao checkpoints are written the way a user makes one: transformers' TorchAoConfig at load,
then save_pretrained. With torchao >= 0.14 and transformers >= 4.56 that is safetensors: the
tensor subclasses' inner tensors plus JSON metadata whose class names torchao checks against an
allowlist (no pickle, nothing executed). quanto checkpoints cannot be saved by transformers
(its quantizer is not serializable), so a "quanto" directory is a full-precision checkpoint whose
config asks transformers to quantize on load.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_cli import invoke, ok, read_output, rows_by_id, runner, write_parquet  # noqa: F401  (runner: fixture)

pytest.importorskip("torchao")

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog.", "12345", "naïve café ☕"]
MAX_NEW = 8


def _save_torchao_checkpoint(src_dir, out_dir, config) -> None:
    from transformers import TorchAoConfig

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32, local_files_only=True,
                                                 quantization_config=TorchAoConfig(config))
    model.save_pretrained(out_dir)  # safetensors by default
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src_dir / name).exists():
            shutil.copy(src_dir / name, out_dir / name)


def _hf_greedy_texts(model_dir, tokenizer) -> list[str]:
    """The pre-quantized model's own greedy continuations, loaded independently by transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True,
                                                 attn_implementation="sdpa").eval()
    texts = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=True)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def _run_texts(runner, model_dir, tmp_path) -> list[str]:  # noqa: F811
    src = write_parquet(tmp_path / "in.parquet", text=PROMPTS)
    out = tmp_path / "out"
    ok(invoke(runner, model_dir, src, out, "--no-chat", "--max-new-tokens", MAX_NEW))
    rows = rows_by_id(read_output(out))
    return [rows[f"in.parquet:{i}"]["generated_text"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("scheme", ["int8-weight", "int8"])
def test_torchao_checkpoint_runs_and_equals_its_own_generate(runner, tiny_model_dir, tokenizer, tmp_path,  # noqa: F811
                                                             scheme):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    config = {"int8-weight": Int8WeightOnlyConfig, "int8": Int8DynamicActivationInt8WeightConfig}[scheme]()
    model_dir = tmp_path / "torchao"
    _save_torchao_checkpoint(tiny_model_dir, model_dir, config)
    assert (model_dir / "model.safetensors").exists() and not list(model_dir.glob("*.bin"))
    assert json.loads((model_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"

    from batchgen.engine.model.loader import load_model
    loaded = load_model(str(model_dir), device="cpu", dtype="float32")
    assert loaded.quantization == "prequantized:torchao"
    assert type(loaded.model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"

    texts = _run_texts(runner, model_dir, tmp_path)
    assert any(texts) and texts == _hf_greedy_texts(model_dir, tokenizer)


def test_quanto_config_quantizes_on_load_and_runs(runner, tiny_model_dir, tokenizer, tmp_path):  # noqa: F811
    pytest.importorskip("optimum.quanto")
    model_dir = tmp_path / "quanto"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "quanto", "weights": "int8", "activations": None}
    (model_dir / "config.json").write_text(json.dumps(config))

    from batchgen.engine.model.loader import load_model
    loaded = load_model(str(model_dir), device="cpu", dtype="float32")
    assert loaded.quantization == "prequantized:quanto"
    assert type(loaded.model.model.layers[0].mlp.up_proj).__name__ == "QLinear"

    texts = _run_texts(runner, model_dir, tmp_path)
    assert any(texts) and texts == _hf_greedy_texts(model_dir, tokenizer)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_scheme_our_forward_cannot_run_is_refused_naming_it(runner, tiny_model_dir, tmp_path, method):  # noqa: F811
    model_dir = tmp_path / "model"  # not named after the method: the message must name it itself
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (model_dir / "config.json").write_text(json.dumps(config))
    src = write_parquet(tmp_path / "in.parquet", text=PROMPTS)
    result = invoke(runner, model_dir, src, tmp_path / "out")
    assert result.exit_code == 2, result.output
    message = result.output + (result.stderr if result.stderr_bytes else "")
    assert f"pre-quantized with {method!r}" in message, message
