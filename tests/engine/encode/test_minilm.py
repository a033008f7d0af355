"""all-MiniLM-L6-v2 (real weights) embeds as sentence-transformers' encode does."""

from __future__ import annotations

from pydoc_data.topics import topics

import numpy as np
from sentence_transformers import SentenceTransformer

from batchgen.config.choices import Pooling, Task
from batchgen.engine.encode.encoder import Encoder, EncodeRequest, encode_all
from batchgen.engine.encode.load import load_encode_model
from tests.minilm import minilm_dir


def _texts() -> list[str]:
    """40 paragraphs of mixed length; the longest run past max_seq_length (256 tokens) and are cut."""
    paragraphs = sorted({p.strip() for text in topics.values() for p in text.split("\n\n") if p.strip()})
    by_length = sorted(paragraphs[:400], key=len)
    return by_length[::10][:38] + [max(paragraphs, key=len), "a"]


def test_minilm_equals_sentence_transformers_encode():
    directory = str(minilm_dir())
    texts = _texts()
    reference = SentenceTransformer(directory, device="cpu").encode(texts, batch_size=32)
    model = load_encode_model(directory, Task.EMBED, dtype="float32")
    assert (model.pooling, model.normalize, model.max_input_tokens, model.embedding_dim) == (Pooling.MEAN, True,
                                                                                             256, 384)
    ids = [model.truncate(row)[0] for row in model.tokenizer(texts)["input_ids"]]
    assert max(map(len, ids)) == 256
    requests = [EncodeRequest(str(i), tuple(row)) for i, row in enumerate(ids)]
    for budget in (300, 4096):
        got = np.stack([r.embedding for r in encode_all(Encoder(model, max_num_batched_tokens=budget), requests)])
        cosines = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
        assert cosines.min() >= 0.9999, budget
