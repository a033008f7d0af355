"""score equals transformers' own forward: log-softmax sums of each row's scored tokens."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Qwen3Config

from batchgen.config.choices import Task
from batchgen.engine.encode import score as score_mod
from batchgen.engine.encode.encoder import Encoder, EncodeRequest, encode_all
from batchgen.engine.encode.heads import LogitRule, check_logit_rule, decoder_of, logit_rule
from batchgen.engine.encode.load import load_encode_model
from batchgen.engine.encode.varlen import pack_for, packed_forward
from batchgen.errors import UnsupportedModelError
from tests.tiny import VOCAB_SIZE, _common, make_tiny_model, save_tiny_model_dir


def _qwen3():
    torch.manual_seed(3)
    config = Qwen3Config(**_common(head_dim=16, use_sliding_window=False))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def _gemma2():
    torch.manual_seed(4)
    config = Gemma2Config(**_common(head_dim=16, final_logit_softcapping=0.5, sliding_window=4096,
                                    query_pre_attn_scalar=16))
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


MODELS = {"llama": lambda: make_tiny_model("llama"), "qwen2": lambda: make_tiny_model("qwen2"),
          "qwen3": _qwen3, "gemma2": _gemma2}


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _reference(model, row, score_from):
    """The model's forward on the row alone: sum of log p(t_i | t_<i) for i in [score_from, L)."""
    logprobs = model(input_ids=torch.tensor([row])).logits[0].float().log_softmax(-1)
    first = max(1, score_from or 1)
    return sum(float(logprobs[i - 1, row[i]]) for i in range(first, len(row))), max(0, len(row) - first)


@torch.no_grad()
def _score(model, rows, score_from):
    """The rows as one packed batch through the decoder, then the LM head on the scored positions."""
    decoder = decoder_of(model)
    batch = pack_for(decoder, rows)
    hidden = packed_forward(decoder, batch, causal=True)
    return score_mod.score_hidden(model.get_output_embeddings(), logit_rule(model.config), hidden,
                                  batch.input_ids, batch.cu_seqlens, score_from)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_score_equals_forward_log_softmax(arch, monkeypatch):
    model = MODELS[arch]()
    # a head chunk of 7 positions: chunks straddle rows
    monkeypatch.setattr(score_mod, "CHUNK_LOGIT_ELEMENTS", 7 * VOCAB_SIZE)
    rows = _rows([1, 2, 5, 17, 40, 9])
    score_from = [None, 1, 3, 10, 50, 9]
    # the reference first: a packed forward leaves the model on the packed attention function
    want = [_reference(model, row, start) for row, start in zip(rows, score_from, strict=True)]
    got = _score(model, rows, score_from)
    for (want_logprob, want_num), (logprob, num) in zip(want, got, strict=True):
        assert num == want_num
        assert logprob == pytest.approx(want_logprob, rel=1e-4, abs=1e-6)
    assert [n for _, n in got] == [0, 1, 2, 7, 0, 0]


def test_batch_composition_does_not_change_a_row():
    model = MODELS["qwen3"]()
    rows = _rows([3, 30, 12, 7], seed=1)
    together = _score(model, rows, [None] * 4)
    alone = [_score(model, [r], [None])[0] for r in rows]
    for (a, n), (b, m) in zip(together, alone, strict=True):
        assert n == m and a == pytest.approx(b, rel=1e-5)


def test_perplexity():
    assert score_mod.perplexity(-2.0 * 4, 4) == pytest.approx(math.exp(2.0))
    assert score_mod.perplexity(0.0, 0) is None


def test_logit_rule_read_from_config():
    model = MODELS["gemma2"]()
    assert logit_rule(model.config) == LogitRule(softcap=0.5)
    check_logit_rule(model, logit_rule(model.config), "tiny-gemma2")
    assert logit_rule(make_tiny_model("llama").config) == LogitRule()


def test_a_model_whose_logits_the_split_misses_is_refused():
    model = MODELS["gemma2"]()
    with pytest.raises(UnsupportedModelError, match="score cannot compute them"):
        check_logit_rule(model, LogitRule(), "tiny-gemma2")


def test_encoder_scores_a_saved_model_whatever_its_batches(tmp_path):
    """--task score end to end in the engine: load_encode_model, then the Encoder under token budgets
    that cut the same rows into other batches, equal to each row's own transformers forward."""
    model_dir = save_tiny_model_dir(tmp_path / "llama")
    reference = make_tiny_model("llama")  # the weights save_tiny_model_dir saved
    rows = _rows([12, 3, 40, 1, 25, 7], seed=2)
    score_from = [None, 2, 30, None, 1, 7]
    want = [_reference(reference, row, start) for row, start in zip(rows, score_from, strict=True)]
    model = load_encode_model(model_dir, Task.SCORE, dtype="float32", device="cpu")
    requests = [EncodeRequest(str(i), tuple(r), score_from=s) for i, (r, s) in enumerate(zip(rows, score_from,
                                                                                             strict=True))]
    for budget in (16, 48, 4096):
        results = encode_all(Encoder(model, max_num_batched_tokens=budget), requests)
        for (want_logprob, want_num), row, result in zip(want, rows, results, strict=True):
            assert result.num_prompt_tokens == len(row) and result.num_scored_tokens == want_num
            assert result.logprob == pytest.approx(want_logprob, rel=1e-4, abs=1e-6)
