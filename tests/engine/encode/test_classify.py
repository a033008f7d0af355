"""classify equals the model's own logits, whatever rows share a batch."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    DistilBertConfig,
    LlamaConfig,
    ModernBertConfig,
    RobertaConfig,
)

from batchgen.config.choices import Task
from batchgen.engine.encode import classify
from batchgen.engine.encode.classify import HeadKind
from batchgen.engine.encode.encoder import Encoder, EncodeRequest, encode_all
from batchgen.engine.encode.load import load_encode_model
from batchgen.engine.encode.varlen import pack_for, packed_forward
from tests.tiny import VOCAB_SIZE, _common, make_tokenizer

LABELS = {0: "low", 1: "mid", 2: "high"}
_ENCODER = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128, pad_token_id=0)


def _build(config, seed=0):
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.float32).eval()


MODELS = {
    "bert": lambda: _build(BertConfig(**_ENCODER, id2label=LABELS)),
    "bert-multi-label": lambda: _build(BertConfig(**_ENCODER, id2label=LABELS,
                                                  problem_type="multi_label_classification")),
    "roberta": lambda: _build(RobertaConfig(**{**_ENCODER, "pad_token_id": 1}, id2label=LABELS)),
    "llama-reward": lambda: _build(LlamaConfig(**_common(num_labels=1))),
    "modernbert-mean": lambda: _build(ModernBertConfig(**{**_ENCODER, "num_attention_heads": 2},
                                                       classifier_pooling="mean", id2label=LABELS)),
    "modernbert-cls": lambda: _build(ModernBertConfig(**{**_ENCODER, "num_attention_heads": 2},
                                                      classifier_pooling="cls", id2label=LABELS)),
    "distilbert": lambda: _build(DistilBertConfig(vocab_size=VOCAB_SIZE, dim=32, hidden_dim=64, n_layers=2,
                                                  n_heads=4, max_position_embeddings=128, pad_token_id=0,
                                                  id2label=LABELS)),
}
KINDS = {"bert": HeadKind.BERT_POOLER, "bert-multi-label": HeadKind.BERT_POOLER, "roberta": HeadKind.FIRST_TOKEN,
         "llama-reward": HeadKind.LAST_TOKEN, "modernbert-mean": HeadKind.MODERNBERT,
         "modernbert-cls": HeadKind.MODERNBERT, "distilbert": HeadKind.PADDED}


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _logits(model, rows):
    """The rows as one packed batch through the base model, then the head; or the padded fallback."""
    if classify.head_kind(model) is HeadKind.PADDED:
        return classify.padded_logits(model, rows)
    batch = pack_for(model.base_model, rows)
    hidden = packed_forward(model.base_model, batch, causal=classify.is_causal(model))
    return classify.classify_hidden(model, hidden, batch.input_ids, batch.cu_seqlens)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_classify_equals_the_models_logits(name):
    model = MODELS[name]()
    assert classify.head_kind(model) is KINDS[name]
    rows = _rows([1, 9, 33, 4, 60, 2])
    with torch.no_grad():
        want = torch.cat([model(input_ids=torch.tensor([r])).logits for r in rows])
    # the same rows in one batch, in two batches of another order, and alone
    batches = [[0, 1, 2, 3, 4, 5], [4, 1], [5, 0, 3, 2], [2]]
    for batch in batches:
        got = _logits(model, [rows[i] for i in batch])
        torch.testing.assert_close(got, want[batch], rtol=1e-4, atol=1e-5)
    results = classify.scores_and_labels(_logits(model, rows), model.config.problem_type,
                                         model.config.id2label)
    for (scores, label), logit in zip(results, want, strict=True):
        assert scores.dtype == "float32"
        if name == "llama-reward":
            assert label is None and scores.tolist() == pytest.approx(logit.tolist(), rel=1e-4)
            continue
        probs = logit.sigmoid() if name == "bert-multi-label" else logit.softmax(-1)
        assert scores.tolist() == pytest.approx(probs.tolist(), rel=1e-4, abs=1e-6)
        assert label == LABELS[int(logit.argmax())]


def test_reward_model_reads_the_last_token_that_is_not_the_pad_token():
    """A row ending in pad-valued tokens (eos as pad) is read where the class's own forward reads it."""
    model = MODELS["llama-reward"]()
    pad = model.config.pad_token_id
    rows = [[7, 8, 9, pad, pad], [pad, pad], [10, 11]]
    with torch.no_grad():
        want = torch.cat([model(input_ids=torch.tensor([r])).logits for r in rows])
    torch.testing.assert_close(_logits(model, rows), want, rtol=1e-4, atol=1e-5)


def test_scores_for_each_problem_type():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    [(soft, label)] = classify.scores_and_labels(logits, None, LABELS)
    assert label == "mid" and soft.sum() == pytest.approx(1.0)
    [(sig, label)] = classify.scores_and_labels(logits, "multi_label_classification", LABELS)
    assert label == "mid" and sig.tolist() == pytest.approx(torch.sigmoid(logits[0]).tolist())
    [(raw, label)] = classify.scores_and_labels(logits, "regression", LABELS)
    assert label is None and raw.tolist() == [1.0, 3.0, 2.0]


@pytest.mark.parametrize("name", ["bert", "llama-reward", "distilbert"])
def test_encoder_classifies_a_saved_model_whatever_its_batches(name, tmp_path):
    """--task classify end to end in the engine: load_encode_model on a saved checkpoint, then the
    Encoder under token budgets that batch the rows differently, equal to each row's own forward."""
    reference = MODELS[name]()
    reference.save_pretrained(tmp_path / name)
    make_tokenizer(chat=False).save_pretrained(tmp_path / name)
    rows = _rows([5, 30, 2, 17, 9], seed=3)
    with torch.no_grad():
        want = classify.scores_and_labels(torch.cat([reference(input_ids=torch.tensor([r])).logits for r in rows]),
                                          reference.config.problem_type, reference.config.id2label)
    model = load_encode_model(str(tmp_path / name), Task.CLASSIFY, dtype="float32", device="cpu")
    requests = [EncodeRequest(str(i), tuple(r)) for i, r in enumerate(rows)]
    for budget in (16, 4096):
        results = encode_all(Encoder(model, max_num_batched_tokens=budget), requests)
        for (scores, label), result in zip(want, results, strict=True):
            assert result.label == label
            assert result.scores.tolist() == pytest.approx(scores.tolist(), rel=1e-4, abs=1e-6)
