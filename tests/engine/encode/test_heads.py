"""Loading the models of --task score and --task classify."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, BertConfig, RobertaConfig

from batchgen.engine.encode.heads import LogitRule, load_classify_model, load_score_model
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
