"""Refusing early: a model the engine cannot run is refused from its config (config.json or GGUF
metadata) before any GGUF conversion or weight load, naming what is missing."""

from __future__ import annotations

import json

import gguf
import pytest
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from batchgen.engine.model import families, gguf_cache, gguf_metadata, loader
from batchgen.errors import UnsupportedModelError
from tests.tiny import _common


def write_gguf(path, arch: str, name: str = "tiny", **arch_keys) -> str:
    """A GGUF of metadata only (no tensors), with a long string array as a tokenizer has."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    for key, value in arch_keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_token_list([f"t{i}" for i in range(5000)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture
def no_conversion(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("converted or loaded a model that should have been refused first")

    monkeypatch.setattr(gguf_cache, "convert_gguf", fail)
    monkeypatch.setattr(loader, "_load_hf", fail)


def test_gguf_metadata_is_read_without_its_arrays(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "gemma3", **{"attention.sliding_window": 512})
    metadata = gguf_metadata.read_metadata(path)
    assert metadata["general.architecture"] == "gemma3"
    assert metadata["gemma3.attention.sliding_window"] == 512
    assert "tokenizer.ggml.tokens" not in metadata  # skipped, not parsed


def test_a_gguf_sliding_window_model_maps_to_its_config_and_is_accepted(tmp_path):
    config = gguf_metadata.config_from_gguf(write_gguf(tmp_path / "m.gguf", "gemma3",
                                                       **{"attention.sliding_window": 512}))
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert "sliding_attention" in config.layer_types
    families.check_config(config, "m.gguf")


def test_a_gguf_architecture_transformers_cannot_convert_is_refused_before_conversion(tmp_path, no_conversion):
    path = write_gguf(tmp_path / "m.gguf", "rwkv6")
    with pytest.raises(UnsupportedModelError, match="'rwkv6' is one transformers cannot convert"):
        loader.load_model(path, device="cpu", dtype="float32")


def test_a_gguf_model_without_attention_is_refused_before_conversion(tmp_path, no_conversion):
    path = write_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(UnsupportedModelError, match="attention interface"):
        loader.load_model(path, device="cpu", dtype="float32")


def test_a_config_json_with_layers_the_engine_lacks_is_refused_before_weights(tmp_path, no_conversion):
    config = Qwen2Config(**_common(layer_types=["full_attention", "linear_attention"]))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(UnsupportedModelError, match=r"\['linear_attention'\] layers"):
        loader.load_model(str(tmp_path), device="cpu", dtype="float32")


@pytest.mark.parametrize(("config", "windows"), [
    (LlamaConfig(**_common()), [None, None]),
    (MistralConfig(**_common(sliding_window=16)), [16, 16]),
    (Qwen2Config(**_common(use_sliding_window=True, sliding_window=16, max_window_layers=1)), [None, 16]),
    (Qwen2Config(**_common(use_sliding_window=False, sliding_window=16)), [None, None]),
    (Gemma2Config(**_common(head_dim=16, sliding_window=16)), [16, None]),
], ids=["llama", "mistral", "qwen2-window-layers", "qwen2-no-window", "gemma2"])
def test_layer_windows_follow_transformers_masks(config, windows):
    assert families.layer_windows(config) == windows


@pytest.mark.parametrize(("attr", "value", "match"), [
    ("use_bidirectional_attention", True, "bidirectional"),
    ("attention_chunk_size", 64, "chunked"),
    ("num_kv_shared_layers", 1, "another layer's KV cache"),
    ("is_encoder_decoder", True, "encoder-decoder"),
])
def test_features_the_engine_lacks_are_named(attr, value, match):
    config = LlamaConfig(**_common())
    setattr(config, attr, value)
    with pytest.raises(UnsupportedModelError, match=match):
        families.check_config(config, "m")


def test_a_local_global_model_gets_kv_groups_where_its_modules_agree(caplog):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma2Config(**_common(head_dim=16, sliding_window=16)))
    groups = families.kv_groups(model)
    assert groups.group_windows == (None, 16) and groups.layer_group == (1, 0)
    assert families.kv_window(model) is None  # not every layer has the window
    assert families.kv_groups(AutoModelForCausalLM.from_config(MistralConfig(**_common(sliding_window=16)))) is None
    model.model.layers[0].self_attn.sliding_window = 8  # disagrees with its config: all KV kept
    with caplog.at_level("WARNING"):
        assert families.kv_groups(model) is None
    assert "keeping all KV" in caplog.text
