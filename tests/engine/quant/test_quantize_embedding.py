"""int8 embedding / LM head (engine/quant/embedding.py): values, shapes, tying, the engine."""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.engine.quant import quantize
from batchgen.engine.quant.embedding import (
    INT8_GEMV_MAX_ROWS,
    Int8Embedding,
    Int8LMHead,
    quantize_embeddings,
    quantize_rows,
)
from tests.engine.greedy_pair import generate_and_engine_tokens
from tests.tiny import make_tiny_model


def tied_model(seed: int, dtype: torch.dtype = torch.bfloat16):
    model = make_tiny_model("llama", seed=seed)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model.to(dtype)


def test_rows_round_to_the_nearest_step_of_their_own_scale():
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 300)[:, None]
    q, s = quantize_rows(w, torch.float32)
    assert q.dtype == torch.int8 and s.shape == (300,)
    assert q.abs().max() == 127
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()
    zero = quantize_rows(torch.zeros(2, 8), torch.bfloat16)
    assert (zero[0] == 0).all() and torch.isfinite(zero[1].float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_equal_their_dequantized_matrix(dtype):
    w = torch.randn(500, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    q, s = quantize_rows(w, dtype)
    dense = (q.to(dtype) * s[:, None])
    ids = torch.tensor([[0, 5, 499], [7, 7, 3]])
    assert torch.equal(Int8Embedding(q, s)(ids), dense[ids])
    for rows in (3, INT8_GEMV_MAX_ROWS + 5):  # aten's int8 GEMV, then the sliced path
        x = torch.randn(2, rows, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
        got, want = Int8LMHead(q, s)(x), torch.nn.functional.linear(x, dense)
        assert got.shape == (2, rows, 500) and got.dtype == dtype
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def test_tied_pair_shares_one_int8_matrix_and_logits_stay_close():
    model = tied_model(seed=3)
    original = copy.deepcopy(model)
    assert quantize.quantize_model(model, "none", "auto", "int8").label == "none+int8-embedding"
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embedding, Int8Embedding) and isinstance(head, Int8LMHead)
    assert head.qweight is embedding.qweight and head.scale is embedding.scale
    assert head.weight.shape == original.lm_head.weight.shape  # the engine reads the vocabulary size there
    saved = original.lm_head.weight.numel()  # bf16 -> int8 (+ one bf16 scale per row)
    assert quantize.weight_bytes(original) - quantize.weight_bytes(model) == saved - 2 * head.scale.numel()
    # the reference: the same model with the dequantized matrix, tied
    ref = copy.deepcopy(original)
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(embedding.qweight.to(torch.bfloat16) * embedding.scale[:, None])
    ids = torch.randint(5, 261, (1, 30), generator=torch.Generator().manual_seed(4))
    keep = torch.tensor([3, 17, 29])  # the engine's packed forward asks for a few rows only
    with torch.no_grad():
        got = model(ids, logits_to_keep=keep).logits.float()
        want = ref(ids, logits_to_keep=keep).logits.float()
        full = original(ids, logits_to_keep=keep).logits.float()
    assert got.shape == want.shape == (1, 3, original.config.vocab_size)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # kernel rounding only
    assert (got - full).abs().max() <= 0.1 * full.abs().max()  # and near the bf16 model


def test_untied_model_quantizes_each_matrix():
    model = make_tiny_model("llama", seed=4).to(torch.bfloat16)
    head_before = model.lm_head.weight.clone()
    quantize_embeddings(model)
    assert model.lm_head.qweight is not model.model.embed_tokens.qweight
    dense = model.lm_head.qweight.float() * model.lm_head.scale.float()[:, None]
    assert (dense - head_before.float()).abs().max() <= model.lm_head.scale.float().max()


@pytest.mark.parametrize(("scheme", "backend", "dtype"),
                         [("int8-weight", "quanto", torch.float32), ("int8-weight", "torchao", torch.float32),
                          ("int4", "torchao", torch.bfloat16), ("int4", "quanto", torch.float32)])
def test_engine_greedy_equals_generate_with_an_int8_embedding(tokenizer, scheme, backend, dtype):
    pytest.importorskip("torchao")
    pytest.importorskip("optimum.quanto")
    model = tied_model(seed=6, dtype=dtype)
    applied = quantize.quantize_model(model, scheme, backend, "int8")
    assert applied.embedding == "int8"
    refs, got = generate_and_engine_tokens(model, tokenizer)
    if dtype == torch.float32:
        assert got == refs
    else:  # bf16: packed vs unpacked rows may round differently; the first tokens must agree
        assert [g[:2] for g in got] == [r[:2] for r in refs]
