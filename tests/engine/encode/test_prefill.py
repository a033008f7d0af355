"""score on the engine's prefill path: no padding, long rows in chunks over a scratch cache, equal to
transformers' own forward log-softmax sums."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from batchgen.config.choices import Task
from batchgen.engine.encode import score as score_mod
from batchgen.engine.encode.encoder import Encoder, EncodeRequest, encode_all
from batchgen.engine.encode.heads import logit_rule, prepare_cpu_forward
from batchgen.engine.encode.load import load_encode_model
from batchgen.engine.encode.packing import pack
from batchgen.engine.encode.prefill import PrefillForward
from tests.tiny import VOCAB_SIZE, _common, make_tiny_model, save_tiny_model_dir


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _reference(model, row, score_from=None):
    logprobs = model(input_ids=torch.tensor([row])).logits[0].float().log_softmax(-1)
    first = max(1, score_from or 1)
    return sum(float(logprobs[i - 1, row[i]]) for i in range(first, len(row))), max(0, len(row) - first)


def _gemma2_window():
    """Sliding-window layers (8 tokens) beside full ones, attention softcap, final logit softcap."""
    torch.manual_seed(5)
    config = Gemma2Config(**_common(head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=20.0,
                                    sliding_window=8, query_pre_attn_scalar=16))
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def _assert_scores(got, want):
    for (want_logprob, want_num), (logprob, num) in zip(want, got, strict=True):
        assert num == want_num
        assert logprob == pytest.approx(want_logprob, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_long_rows_run_in_chunks_through_the_cache(arch):
    """A row longer than the budget runs in chunks attending the ones before through the scratch cache
    (across a sliding window and softcaps for gemma2); the cache grows to hold it, and a batch of
    several rows after it reuses the cache."""
    model = make_tiny_model("llama") if arch == "llama" else _gemma2_window()
    prepare_cpu_forward(model)
    long_row, *short = _rows([53, 9, 4, 1, 2], seed=3)
    score_from = [None, 40]  # the continuation starts inside the fourth chunk of the long row
    want_long = [_reference(model, long_row, s) for s in score_from]
    want_short = [_reference(model, row) for row in short]
    prefill = PrefillForward(model, max_num_batched_tokens=16)
    calls = []
    prefill.decoder.register_forward_hook(lambda module, args, output: calls.append(1))
    head, rule = model.get_output_embeddings(), logit_rule(model.config)

    small = pack(short)
    first = score_mod.score_hidden(head, rule, prefill.hidden(small), small.input_ids, small.cu_seqlens,
                                   [None] * len(short))
    assert len(calls) == 1 and prefill.cache_blocks == 4  # one block a row (9, 4, 1 and 2 tokens)
    long = pack([long_row])
    hidden = prefill.hidden(long)
    assert len(calls) == 1 + 4 and prefill.cache_blocks == 4  # chunks of 16, 16, 16, 5; 4 blocks of 16
    got_long = [score_mod.score_hidden(head, rule, hidden, long.input_ids, long.cu_seqlens, [s])[0]
                for s in score_from]
    again = score_mod.score_hidden(head, rule, prefill.hidden(small), small.input_ids, small.cu_seqlens,
                                   [None] * len(short))
    _assert_scores(first, want_short)
    _assert_scores(got_long, want_long)
    assert again == first


def test_a_long_row_grows_the_scratch_cache():
    model = make_tiny_model("llama")
    prepare_cpu_forward(model)
    short, long_row = _rows([5, 100], seed=4)
    want = [_reference(model, short), _reference(model, long_row)]
    prefill = PrefillForward(model, max_num_batched_tokens=32)
    head, rule = model.get_output_embeddings(), logit_rule(model.config)
    got = []
    for row in (short, long_row):
        batch = pack([row])
        got += score_mod.score_hidden(head, rule, prefill.hidden(batch), batch.input_ids, batch.cu_seqlens, [None])
    assert prefill.cache_blocks == 7  # ceil(100 / 16): the whole row's K/V, past the 32-token budget
    _assert_scores(got, want)


def test_encoder_scores_unpadded_with_continuations(tmp_path):
    """--task score in the Encoder: batches fill the budget with real tokens (no [rows, longest] layout),
    continuations (score_from, as --score-column makes them) start anywhere, even in a later chunk, and
    every row equals its own transformers forward."""
    model_dir = save_tiny_model_dir(tmp_path / "llama")
    reference = make_tiny_model("llama")
    rows = _rows([40, 3, 20, 1, 20, 20], seed=6)
    score_from = [35, 2, 12, 1, None, 17]
    want = [_reference(reference, row, s) for row, s in zip(rows, score_from, strict=True)]
    model = load_encode_model(model_dir, Task.SCORE, dtype="float32", device="cpu")
    requests = [EncodeRequest(str(i), tuple(r), score_from=s) for i, (r, s) in enumerate(zip(rows, score_from,
                                                                                             strict=True))]
    for budget in (16, 64):
        encoder = Encoder(model, max_num_batched_tokens=budget)
        results = encode_all(encoder, requests)
        _assert_scores([(r.logprob, r.num_scored_tokens) for r in results], want)
        assert encoder.num_attention_tokens == encoder.num_needed_tokens == sum(map(len, rows))
        assert encoder.padding_waste == 1.0
    # 104 tokens under a 64-token budget: two batches of real tokens, [40, 20] and [20, 20, 3, 1] (a
    # [rows, longest] layout needs three: [40], [20, 20, 20], [3, 1])
    assert encoder.num_batches == 2
