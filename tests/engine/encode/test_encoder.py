"""The Encoder's score and classify batches equal transformers' own forward; st_config refuses what it cannot do."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertForSequenceClassification

from batchgen.config.choices import Task
from batchgen.engine.encode.encoder import Encoder, EncodeRequest, encode_all
from batchgen.engine.encode.load import load_encode_model
from batchgen.engine.encode.st_config import read_st_config
from batchgen.errors import UnsupportedModelError
from tests.tiny import VOCAB_SIZE, make_tokenizer, save_tiny_model_dir

ROWS = [[1, 40, 41, 42], [1, 50], [1] + list(range(60, 90)), [1, 7, 8, 9, 10, 11]]


def test_score_batches_equal_the_causal_lms_log_softmax(tmp_path):
    directory = save_tiny_model_dir(tmp_path / "llama")
    model = load_encode_model(directory, Task.SCORE, dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = []
    for row in ROWS:
        with torch.no_grad():
            logprobs = reference(input_ids=torch.tensor([row])).logits[0].float().log_softmax(-1)
        expected.append(sum(logprobs[i - 1, row[i]].item() for i in range(2, len(row))))  # score_from=2
    for budget in (8, 64):
        results = encode_all(Encoder(model, max_num_batched_tokens=budget),
                             [EncodeRequest(str(i), tuple(r), score_from=2) for i, r in enumerate(ROWS)])
        assert [r.num_scored_tokens for r in results] == [len(r) - 2 for r in ROWS]
        for result, value in zip(results, expected, strict=True):
            assert result.logprob == pytest.approx(value, rel=1e-4, abs=1e-4)


def test_classify_batches_equal_the_classifiers_logits(tmp_path):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                        id2label={0: "neg", 1: "pos"}, architectures=["BertForSequenceClassification"])
    BertForSequenceClassification(config).save_pretrained(tmp_path / "clf")
    make_tokenizer(chat=False).save_pretrained(tmp_path / "clf")
    model = load_encode_model(str(tmp_path / "clf"), Task.CLASSIFY, dtype="float32")
    reference = BertForSequenceClassification.from_pretrained(tmp_path / "clf", dtype=torch.float32).eval()
    results = encode_all(Encoder(model, max_num_batched_tokens=40),
                         [EncodeRequest(str(i), tuple(r)) for i, r in enumerate(ROWS)])
    for row, result in zip(ROWS, results, strict=True):
        with torch.no_grad():
            probs = reference(input_ids=torch.tensor([row])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.from_numpy(result.scores), probs, rtol=1e-4, atol=1e-5)
        assert result.label == ("pos" if probs[1] > probs[0] else "neg")


def _st_dir(tmp_path, modules, pooling=None, st_config=None):
    tmp_path.mkdir()
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
         for i, (kind, path) in enumerate(modules)]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling or {"word_embedding_dimension": 8,
                                                                                "pooling_mode_cls_token": True}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(st_config or {"max_seq_length": 12}))
    return tmp_path


def test_st_config_reads_the_legacy_layout_and_refuses_what_it_cannot_embed(tmp_path):
    layout = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    config = read_st_config(_st_dir(tmp_path / "ok", layout))
    assert (config.pooling.value, config.normalize, config.embedding_dim, config.max_seq_length) == ("cls", True, 8, 12)
    with pytest.raises(UnsupportedModelError, match="Dense"):
        read_st_config(_st_dir(tmp_path / "dense", layout[:2] + [("Dense", "2_Dense")]))
    with pytest.raises(UnsupportedModelError, match="max"):
        read_st_config(_st_dir(tmp_path / "max", layout, pooling={"pooling_mode": "max"}))
    with pytest.raises(UnsupportedModelError, match="mean \\+ cls"):
        read_st_config(_st_dir(tmp_path / "two", layout, pooling={"pooling_mode": ["mean", "cls"]}))
    with pytest.raises(UnsupportedModelError, match="do_lower_case"):
        read_st_config(_st_dir(tmp_path / "lower", layout, st_config={"do_lower_case": True}))
