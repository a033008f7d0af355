"""embed equals sentence-transformers' encode, whatever rows share a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, Qwen3Config, Qwen3ForCausalLM

from batchgen.config.choices import Pooling, Task
from batchgen.engine.encode.encoder import Encoder, EncodeRequest, encode_all
from batchgen.engine.encode.load import load_encode_model
from batchgen.errors import ConfigError
from tests.engine.encode.st_models import save_st_model, wrapping_tokenizer
from tests.tiny import _common

TEXTS = ["a", "hello world", "the quick brown fox jumps over the lazy dog", "x" * 23, "yz" * 40,
         "batch jobs beyond generation", "Ünïcödé tëxt ✓", "short", "one more row of medium length here",
         "tokens " * 9, "b", "packed rows must not see each other", "  leading spaces", "the end."]
BUDGETS = [16, 40, 100_000]  # one row a batch (a row longer than the budget runs alone) ... all rows in one


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _embed(model, texts, budget, dimensions=None):
    requests = []
    for i, text in enumerate(texts):
        ids, _ = model.truncate(model.tokenizer(text)["input_ids"])
        requests.append(EncodeRequest(str(i), tuple(ids), dimensions=dimensions))
    return np.stack([r.embedding for r in encode_all(Encoder(model, max_num_batched_tokens=budget), requests)])


@pytest.fixture(scope="module", params=["bert-mean", "xlm-roberta-cls", "modernbert-mean"])
def st_dir(request, tmp_path_factory):
    arch, pooling = request.param.rsplit("-", 1)
    return save_st_model(tmp_path_factory.mktemp("st") / arch, arch, pooling=pooling)


def test_tiny_encoders_equal_sentence_transformers_under_any_batching(st_dir):
    reference = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS, batch_size=32)
    model = load_encode_model(str(st_dir), Task.EMBED, dtype="float32")
    assert model.normalize and model.embedding_dim == 32 and model.max_input_tokens == 24
    for budget in BUDGETS:
        got = _embed(model, TEXTS, budget)
        assert got.dtype == np.float32 and got.shape == reference.shape
        assert _cosines(got, reference).min() >= 0.9999, budget
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_truncation_keeps_the_special_tokens_as_sentence_transformers_does(st_dir):
    st = SentenceTransformer(str(st_dir), device="cpu")
    model = load_encode_model(str(st_dir), Task.EMBED, dtype="float32")
    long_text = "a long row that sentence-transformers cuts at max_seq_length " * 3
    ids, truncated = model.truncate(model.tokenizer(long_text)["input_ids"])
    assert truncated and len(ids) == 24
    assert ids == st.preprocess([long_text])["input_ids"][0].tolist()
    assert model.truncate([1, 5, 2]) == ([1, 5, 2], False)


def test_dimensions_cut_then_normalize(tmp_path):
    st_dir = save_st_model(tmp_path / "bert", "bert")
    reference = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS, truncate_dim=8,
                                                                      normalize_embeddings=True)
    model = load_encode_model(str(st_dir), Task.EMBED, dtype="float32", dimensions=8)
    assert model.embedding_dim == 8
    got = _embed(model, TEXTS, 40)
    assert got.shape == (len(TEXTS), 8)
    assert _cosines(got, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    # a request's own cut (an OpenAI line's dimensions) beside the job's
    whole = load_encode_model(str(st_dir), Task.EMBED, dtype="float32")
    mixed = encode_all(Encoder(whole), [EncodeRequest("a", (1, 70, 2), dimensions=4), EncodeRequest("b", (1, 70, 2))])
    assert [r.embedding.shape for r in mixed] == [(4,), (32,)]
    np.testing.assert_allclose(mixed[0].embedding, mixed[1].embedding[:4] / np.linalg.norm(mixed[1].embedding[:4]),
                               rtol=1e-5)
    with pytest.raises(ConfigError, match="--dimensions 33"):
        load_encode_model(str(st_dir), Task.EMBED, dtype="float32", dimensions=33)


def test_normalize_and_pooling_overrides(tmp_path):
    st_dir = save_st_model(tmp_path / "bert", "bert", normalize=False)
    st = SentenceTransformer(str(st_dir), device="cpu")
    raw = load_encode_model(str(st_dir), Task.EMBED, dtype="float32")
    assert not raw.normalize and raw.pooling is Pooling.MEAN
    got = _embed(raw, TEXTS, 40)
    np.testing.assert_allclose(got, st.encode(TEXTS), rtol=1e-4, atol=1e-5)  # same vectors, not unit length
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() > 0.01
    unit = _embed(load_encode_model(str(st_dir), Task.EMBED, dtype="float32", normalize=True), TEXTS, 40)
    np.testing.assert_allclose(unit, st.encode(TEXTS, normalize_embeddings=True), rtol=1e-4, atol=1e-5)
    cls = _embed(load_encode_model(str(st_dir), Task.EMBED, dtype="float32", pooling=Pooling.CLS), TEXTS, 40)
    plain = AutoModel.from_pretrained(str(st_dir))
    with torch.no_grad():
        first = [plain(input_ids=torch.tensor([raw.truncate(raw.tokenizer(t)["input_ids"])[0]]))
                 .last_hidden_state[0, 0].numpy() for t in TEXTS[:3]]
    np.testing.assert_allclose(cls[:3], np.stack(first), rtol=1e-4, atol=1e-5)


def test_decoder_last_token_pooling_equals_a_padded_transformers_forward(tmp_path):
    torch.manual_seed(0)
    config = Qwen3Config(**_common(head_dim=16))
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "qwen3")
    tokenizer = wrapping_tokenizer()
    tokenizer.save_pretrained(tmp_path / "qwen3")
    model = load_encode_model(str(tmp_path / "qwen3"), Task.EMBED, dtype="float32")
    assert model.causal and model.pooling is Pooling.LAST and model.normalize
    rows = [tokenizer(t)["input_ids"] for t in TEXTS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    base = AutoModel.from_pretrained(str(tmp_path / "qwen3"), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
    last = hidden[torch.arange(len(rows)), mask.sum(1) - 1]
    reference = torch.nn.functional.normalize(last, dim=1).numpy()
    for budget in BUDGETS:
        got = np.stack([r.embedding for r in encode_all(
            Encoder(model, max_num_batched_tokens=budget),
            [EncodeRequest(str(i), tuple(r)) for i, r in enumerate(rows)])])
        assert _cosines(got, reference).min() >= 0.9999, budget
