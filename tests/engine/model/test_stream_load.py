"""Quantize-while-loading (engine/model/stream_load.py) gives the weights quantize-after-load gives."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.engine.model import loader, stream_load
from batchgen.engine.quant import quantize
from tests.tiny import make_tiny_model, make_tokenizer

pytest.importorskip("torchao")
pytest.importorskip("optimum.quanto")


def plain_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, a quantized tensor subclass as its inner tensors."""
    out: dict[str, torch.Tensor] = {}

    def visit(name: str, t: torch.Tensor) -> None:
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
            for attr in flatten()[0]:
                visit(f"{name}.{attr}", getattr(t, attr))
        else:
            out[name] = t.detach()

    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        visit(name, t)
    return out


def model_dir(tmp_path, tied: bool) -> str:
    model = make_tiny_model("llama", seed=7)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.save_pretrained(tmp_path)  # float32, like the converted GGUF of the default model
    make_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(("scheme", "backend", "embedding", "tied"),
                         [("int4", "torchao", "int8", True), ("int4", "quanto", "int8", True),
                          ("int8-weight", "quanto", "none", True), ("int8", "torchao", "none", False),
                          ("int4", "torchao", "int8", False)])
def test_streamed_weights_equal_quantize_after_load(tmp_path, scheme, backend, embedding, tied):
    path = model_dir(tmp_path, tied)
    streamed, label = stream_load.load_quantized("tiny", path, torch.bfloat16, scheme, backend, embedding)
    after, _ = loader._load_hf("tiny", path, torch.bfloat16, False)
    assert quantize.quantize_model(after.eval(), scheme, backend, embedding).label == label
    got, want = plain_tensors(streamed), plain_tensors(after)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    head, emb = streamed.get_output_embeddings(), streamed.get_input_embeddings()
    assert (head.weight is emb.weight or getattr(head, "qweight", None) is getattr(emb, "qweight", 0)) == tied
    ids = torch.randint(5, 261, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(streamed(ids).logits, after(ids).logits)
    assert streamed.generation_config.eos_token_id == after.generation_config.eos_token_id


def test_load_model_streams_a_local_checkpoint_on_cpu(tmp_path, monkeypatch):
    path = model_dir(tmp_path, tied=True)

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained: the model should have been streamed")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    lm = loader.load_model(path, device="cpu", dtype="bfloat16", quantize="int4", quantize_backend="torchao")
    assert lm.quantization == "int4/torchao+int8-embedding"
    assert lm.eos_token_ids and lm.max_context_tokens == 512


def test_a_checkpoint_that_does_not_match_loads_the_usual_way(tmp_path):
    path = model_dir(tmp_path, tied=False)
    with stream_load.parameters_on_meta():
        config = AutoConfig.from_pretrained(path)
        config.intermediate_size = 96  # the file's MLP weights no longer fit
        skeleton = AutoModelForCausalLM.from_config(config)
    assert not stream_load.stream_load(skeleton, path, torch.float32, lambda p, c: None, set())
    assert stream_load.read_index(str(tmp_path / "nowhere")) is None


def test_read_tensor_in_chunks_equals_safetensors(tmp_path, monkeypatch):
    path = model_dir(tmp_path, tied=False)
    monkeypatch.setattr(stream_load, "READ_CHUNK_BYTES", 1000)  # many chunks, a ragged last one
    index = stream_load.read_index(path)
    want = load_file(f"{path}/model.safetensors")
    assert index.keys() == want.keys()
    for name, (file, entry) in index.items():
        assert torch.equal(stream_load.read_tensor(file, entry, None), want[name]), name
        assert torch.equal(stream_load.read_tensor(file, entry, torch.bfloat16), want[name].to(torch.bfloat16))


def test_parameters_on_meta_keeps_buffers_real():
    with stream_load.parameters_on_meta():
        model = make_tiny_model("llama")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # restored afterwards
