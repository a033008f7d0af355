"""vLLM's min_p, stop_token_ids, include_stop_str_in_output and skip_special_tokens, in the
sampler, the stop checker and the engine. The byte-level test tokenizer maps every
byte to one token (ids 0-4 are specials), so a text fixes its tokens exactly."""

from __future__ import annotations

import collections
import copy

import torch

from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import FinishReason, Request, SamplingParams
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sampling.stopping import StopChecker
from batchgen.engine.sequence import Sequence
from tests.engine.sampling.test_stopping import encode, feed, new_seq
from tests.tiny import BYTE_OFFSET, make_tiny_model

EOS = 2
IM_START = 3  # "<|im_start|>", a special token


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    sampler = Sampler()
    # logprobs: the draw keeps its window, where the kept set is read
    seq = Sequence.from_request(0, Request("0", [1], SamplingParams(temperature=1.0, min_p=min_p, seed=0,
                                                                    logprobs=0)))
    sampler.sample(logits[None], [seq])
    drawn = sampler.last_draw
    out = torch.full_like(logits, float("-inf"))
    keep = torch.isfinite(drawn.values[0])
    out[drawn.value_ids[0][keep]] = logits[drawn.value_ids[0][keep]]
    return out


def _draws(sampler: Sampler, logits: torch.Tensor, seq: Sequence, n: int) -> collections.Counter:
    out = collections.Counter()
    for _ in range(n):
        token = sampler.sample(logits, [seq])[0]
        seq.token_ids.append(token)  # the next draw is the next output index's
        out[token] += 1
    return out


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(_min_p(logits, 0.5)).tolist()
    assert kept == [True, True, False, False]  # 0.3 >= 0.5 * 0.5 > 0.15
    assert torch.isfinite(_min_p(logits, 1.0)).tolist() == [True, False, False, False]


def test_sampler_with_min_p_draws_only_the_kept_tokens():
    sampler = Sampler()
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.15, 0.1]]))
    seq = Sequence.from_request(0, Request("0", [1], SamplingParams(temperature=1.0, min_p=0.5, seed=3)))
    assert set(_draws(sampler, logits, seq, 300)) == {0, 1}  # 0.15 and 0.1 are below 0.5 * 0.4
    plain = Sequence.from_request(1, Request("1", [1], SamplingParams(temperature=1.0, seed=3)))
    assert len(_draws(sampler, logits, plain, 300)) == 4


def test_a_stop_token_id_ends_the_row_and_leaves_its_text_out(tokenizer):
    checker = StopChecker(tokenizer, [EOS], max_model_len=512)
    text = "abc;def"
    stop_id = encode(tokenizer, ";")[0]
    seq = new_seq(tokenizer, stop_token_ids=(stop_id,), max_new_tokens=100)
    index, reason = feed(checker, seq, encode(tokenizer, text))
    assert (index, reason) == (3, FinishReason.STOP)
    token_ids, out = checker.finalize(seq)
    assert token_ids == encode(tokenizer, "abc;") and out == "abc"
    kept = new_seq(tokenizer, stop_token_ids=(stop_id,), include_stop_str_in_output=True, max_new_tokens=100)
    feed(checker, kept, encode(tokenizer, text))
    assert checker.finalize(kept)[1] == "abc;"


def test_stop_token_ids_end_a_row_even_with_ignore_eos(tokenizer):
    checker = StopChecker(tokenizer, [EOS], max_model_len=512)
    stop_id = encode(tokenizer, "!")[0]
    seq = new_seq(tokenizer, stop_token_ids=(stop_id,), ignore_eos=True, max_new_tokens=100)
    assert feed(checker, seq, [*encode(tokenizer, "a"), EOS, *encode(tokenizer, "b!c")]) == (3, FinishReason.STOP)


def test_include_stop_str_in_output_keeps_the_matched_stop_string(tokenizer):
    checker = StopChecker(tokenizer, [EOS], max_model_len=512)
    seq = new_seq(tokenizer, stop=("STOP", "\n"), include_stop_str_in_output=True, max_new_tokens=100)
    feed(checker, seq, encode(tokenizer, "Hello\nworld STOP more"))
    assert checker.finalize(seq)[1] == "Hello\n"


def test_skip_special_tokens_off_keeps_them_in_the_text(tokenizer):
    checker = StopChecker(tokenizer, [EOS], max_model_len=512)
    ids = [*encode(tokenizer, "a"), IM_START, *encode(tokenizer, "b")]
    skipped = new_seq(tokenizer, max_new_tokens=3)
    feed(checker, skipped, ids)
    assert checker.finalize(skipped)[1] == "ab"
    kept = new_seq(tokenizer, max_new_tokens=3, skip_special_tokens=False)
    feed(checker, kept, ids)
    assert checker.finalize(kept)[1] == "a<|im_start|>b"


def test_engine_stops_on_a_stop_token_id_after_min_tokens(tokenizer):
    """Greedy on the tiny Llama: a stop id the free run emits ends the row there; with min_tokens
    past that point it is masked (like EOS), so the row runs on."""
    model = make_tiny_model("llama", seed=0)
    prompt = [BYTE_OFFSET + b for b in b"stop ids"]

    def run(**sampling) -> list:
        engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(kv_cache_bytes=4 * 2**20), eos_token_ids=[])
        return list(engine.generate([Request("r", prompt, SamplingParams(max_new_tokens=12, **sampling))]))

    (free,) = run()
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 12
    position = 3
    stop_id = free.token_ids[position]
    first = free.token_ids.index(stop_id)
    (stopped,) = run(stop_token_ids=(stop_id,))
    assert stopped.finish_reason is FinishReason.STOP and stopped.token_ids == free.token_ids[:first + 1]
    (held,) = run(stop_token_ids=(stop_id,), min_tokens=12)
    assert stop_id not in held.token_ids and held.finish_reason is FinishReason.LENGTH
