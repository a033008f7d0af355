"""A packed forward equals each row's own forward, whatever rows share the batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, BertConfig, ModernBertConfig, Qwen3Config, XLMRobertaConfig

from batchgen.engine.encode.packing import pack, position_rule
from batchgen.engine.encode.varlen import packed_forward
from tests.tiny import VOCAB_SIZE, _common

_ENCODER = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128, pad_token_id=0)

CONFIGS = {
    "bert": (lambda: BertConfig(**_ENCODER), False),
    "xlm-roberta": (lambda: XLMRobertaConfig(**{**_ENCODER, "pad_token_id": 1}), False),
    # a local window of 8 tokens: the longer rows cross it
    "modernbert": (lambda: ModernBertConfig(**{**_ENCODER, "num_attention_heads": 2}, local_attention=8), False),
    "qwen3": (lambda: Qwen3Config(**_common(head_dim=16)), True),
    "qwen3-window": (lambda: Qwen3Config(**_common(head_dim=16, use_sliding_window=True, sliding_window=6,
                                                   max_window_layers=0)), True),
}


def _model(name):
    torch.manual_seed(0)
    config, causal = CONFIGS[name]
    return AutoModel.from_config(config(), attn_implementation="sdpa", dtype=torch.float32).eval(), causal


def _rows(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_forward_equals_each_rows_own_forward(name):
    model, causal = _model(name)
    rows = _rows(1, [7, 1, 20, 3, 20, 13])
    with torch.no_grad():
        own = [model(input_ids=torch.tensor([r])).last_hidden_state[0] for r in rows]
    batch = pack(rows, rule=position_rule(model))
    hidden = packed_forward(model, batch, causal=causal)
    assert hidden.shape == (sum(len(r) for r in rows), model.config.hidden_size)
    for i, expected in enumerate(own):
        got = hidden[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # after a packed forward the model's own padded forward still masks its padding
    with torch.no_grad():
        ids = torch.tensor([rows[0] + [0] * 5])
        mask = torch.tensor([[1] * 7 + [0] * 5])
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state[0, :7]
    torch.testing.assert_close(padded, own[0], rtol=1e-4, atol=1e-5)


def test_roberta_positions_start_after_padding_idx():
    model, _ = _model("xlm-roberta")
    batch = pack([[5, 6, 7], [8, 9]], rule=position_rule(model))
    assert batch.position_ids.tolist() == [2, 3, 4, 2, 3]
    assert pack([[5, 6, 7], [8, 9]]).position_ids.tolist() == [0, 1, 2, 0, 1]
