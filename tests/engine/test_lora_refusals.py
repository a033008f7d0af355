"""LoRA adapters the engine cannot run exactly as PEFT does are refused before any row runs, naming
the adapter and the option; quantized projections take the update on top of their own matmul."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.lora.adapter import AdapterError, read_adapter
from batchgen.engine.lora.layers import AdapterRows, attach, lora_step
from batchgen.errors import ConfigError
from tests.lora_adapters import make_adapter
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=0)


def engine_with(model, tokenizer, path, **config) -> LLMEngine:
    return LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(lora_adapters={"ad": str(path)}, num_kv_blocks=32,
                                                                   **config), eos_token_ids=[2])


@pytest.mark.parametrize(("options", "message"), [
    (dict(r=4, target_modules=["q_proj"], use_dora=True), r"--lora ad: DoRA \(use_dora\)=True is not supported"),
    (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "--lora ad: modules_to_save=.*not supported"),
    (dict(r=4, target_modules=["embed_tokens"]), "--lora ad: target module 'embed_tokens'.* is not supported"),
    (dict(r=4, target_modules=["lm_head"]), "--lora ad: target module 'lm_head'.* is not supported"),
    (dict(r=128, target_modules=["q_proj"]), r"--lora ad: rank r=128 is not supported \(1 to 64\)"),
    (dict(r=4, target_modules=["q_proj"], bias="lora_only"), "--lora ad: bias='lora_only' is not supported"),
])
def test_unsupported_options_are_refused(model, tokenizer, tmp_path, options, message):
    path = make_adapter(model, tmp_path / "ad", seed=1, **options)
    with pytest.raises(AdapterError, match=message) as info:
        engine_with(model, tokenizer, path)
    assert isinstance(info.value, ConfigError) and info.value.exit_code == 2


def test_adapter_of_another_base_is_refused(model, tokenizer, tmp_path):
    wider = make_tiny_model("llama", seed=0)
    wider.model.layers[0].self_attn.q_proj = torch.nn.Linear(64, 72, bias=False)  # another base's shapes
    path = make_adapter(wider, tmp_path / "ad", seed=1, r=4, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"--lora ad: model.layers.0.self_attn.q_proj is 64 -> 64 in the model, "
                                           r"the adapter's is 64 -> 72"):
        engine_with(model, tokenizer, path)


def test_missing_directory_and_compile_are_refused(model, tokenizer, tmp_path):
    with pytest.raises(AdapterError, match="--lora ad: no adapter_model.safetensors in"):
        engine_with(model, tokenizer, tmp_path / "absent")
    path = make_adapter(model, tmp_path / "ad", seed=1, r=4, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="--lora runs on the eager forward; drop --compile"):
        engine_with(model, tokenizer, path, compile=True)
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(AdapterError, match="--lora ad: peft_type 'PREFIX_TUNING' is not supported"):
        read_adapter("ad", tmp_path / "ad")


def test_int8_projections_add_the_update_to_their_own_output(model, tmp_path):
    from batchgen.engine.quant.quantize import quantize_model

    quantized = copy.deepcopy(model)
    quantize_model(quantized, "int8", backend="onednn")
    path = make_adapter(model, tmp_path / "ad", seed=1, r=8, lora_alpha=16,
                        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    adapter = read_adapter("ad", path)
    layer = quantized.model.layers[0]
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        base = {n: getattr(layer.self_attn if n[0] in "qkv" else layer.mlp, n)(x).clone()
                for n in ("q_proj", "k_proj", "gate_proj", "up_proj")}
        attach(quantized, {"ad": adapter})
        rows = torch.tensor([1, 3, 4])
        with lora_step([AdapterRows("ad", rows)]):
            out = {n: getattr(layer.self_attn if n[0] in "qkv" else layer.mlp, n)(x)
                   for n in ("q_proj", "k_proj", "gate_proj", "up_proj")}
    for name, y in out.items():
        kind = "self_attn" if name[0] in "qkv" else "mlp"
        a, b = adapter.weights[f"model.layers.0.{kind}.{name}"]
        expected = base[name].clone()
        expected[0, rows] += (x[0, rows] @ a.T @ b.T) * adapter.scaling
        assert torch.allclose(y, expected, atol=1e-5), name
        assert torch.equal(y[0, [0, 2]], base[name][0, [0, 2]]), "rows without the adapter keep the base output"


def test_a_forward_replaced_after_attaching_is_wrapped_again(model, tmp_path):
    """Another engine's setup may replace a projection's forward (prepack does, for a layer it did
    not pack before): attaching again wraps the new forward instead of trusting the old mark."""
    import types

    target = copy.deepcopy(model)
    path = make_adapter(model, tmp_path / "ad", seed=1, r=4, target_modules=["q_proj"])
    adapter = read_adapter("ad", path)
    q = target.model.layers[0].self_attn.q_proj
    x = torch.randn(1, 3, 64)
    a, b = adapter.weights["model.layers.0.self_attn.q_proj"]
    expected = torch.nn.functional.linear(x, q.weight) + (x @ a.T @ b.T) * adapter.scaling
    attach(target, {"ad": adapter})
    q.forward = types.MethodType(lambda self, x: torch.nn.functional.linear(x, self.weight), q)
    attach(target, {"ad": adapter})
    with torch.inference_mode(), lora_step([AdapterRows("ad", slice(0, 3))]):
        assert torch.allclose(q(x), expected, atol=1e-5)


def test_an_explicit_kv_cache_budget_holds_the_adapters(model, tokenizer, tmp_path):
    """--kv-cache-memory is the memory the cache and the adapters share: the cache gets what the
    adapters leave, and a budget they fill alone is refused naming them."""
    path = make_adapter(model, tmp_path / "ad", seed=1, r=16, lora_alpha=16,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def engine(budget_bytes: int, lora: dict | None) -> LLMEngine:
        return LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(kv_cache_bytes=budget_bytes, lora_adapters=lora),
                         eos_token_ids=[2])

    plain = engine(1 << 20, None)
    block_bytes = plain.spec.bytes_per_block
    assert plain.block_manager.num_blocks == (1 << 20) // block_bytes
    with_adapter = engine(1 << 20, {"ad": str(path)})
    adapter_bytes = with_adapter.lora_adapters["ad"].device_bytes
    in_out = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128)  # q, k and v, o, the MLP's three
    assert adapter_bytes == 2 * 16 * in_out * 4  # 2 layers of r x (in + out) float32 values
    assert with_adapter.block_manager.num_blocks == ((1 << 20) - adapter_bytes) // block_bytes
    with pytest.raises(ConfigError, match=f"KV cache: the budget of {adapter_bytes} bytes is taken by the LoRA "
                                          f"adapters' {adapter_bytes} bytes"):
        engine(adapter_bytes, {"ad": str(path)})
