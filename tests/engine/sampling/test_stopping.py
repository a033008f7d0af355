"""Stop conditions: EOS, stop strings, ignore_eos, max_new_tokens, the context length.

The byte-level test tokenizer maps every byte to one token, so a text fixes its tokens exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.engine.admission import RequestRejected
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.request import FinishReason, Request, SamplingParams
from batchgen.engine.sampling.stopping import StopChecker
from batchgen.engine.sequence import Sequence, SequenceStatus
from tests.tiny import make_tiny_model

EOS = 2  # "<|eos|>", a special token of the test tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def feed(checker: StopChecker, seq: Sequence, token_ids: list[int]) -> tuple[int | None, FinishReason | None]:
    """Append tokens one at a time as the engine does; return (index, reason) of the first stop."""
    seq.status = SequenceStatus.RUNNING
    for i, t in enumerate(token_ids):
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(t)
        reason = checker.check(seq)
        if reason is not None:
            return i, reason
    return None, None


def new_seq(tokenizer, prompt: str = "prompt: ", **params) -> Sequence:
    return Sequence.from_request(0, Request("r", encode(tokenizer, prompt), SamplingParams(**params)))


@pytest.fixture
def checker(tokenizer) -> StopChecker:
    return StopChecker(tokenizer, [EOS], max_model_len=512)


# ---- StopChecker on crafted tokens ---------------------------------------------------------------

def test_stop_string_cuts_the_text_before_the_match(tokenizer, checker):
    text = "Hello, world! STOP and more"
    seq = new_seq(tokenizer, stop=("STOP",), max_new_tokens=100)
    index, reason = feed(checker, seq, encode(tokenizer, text))
    assert reason is FinishReason.STOP
    assert index == text.index("STOP") + len("STOP") - 1  # the token that completes the match
    token_ids, out = checker.finalize(seq)
    assert out == "Hello, world! "
    assert token_ids == encode(tokenizer, "Hello, world! STOP")


def test_the_earliest_stop_string_wins(tokenizer, checker):
    # "y" completes first and stops generation; the text is cut at the earliest match, "xy",
    # whatever the order of the stop strings
    for stops in (("y", "xy"), ("xy", "y")):
        seq = new_seq(tokenizer, stop=stops, max_new_tokens=100)
        index, reason = feed(checker, seq, encode(tokenizer, "axyz"))
        assert (index, reason) == (2, FinishReason.STOP)
        assert checker.finalize(seq)[1] == "a"


def test_the_first_stop_string_to_complete_ends_generation(tokenizer, checker):
    seq = new_seq(tokenizer, stop=("world", "lo"), max_new_tokens=100)
    index, _ = feed(checker, seq, encode(tokenizer, "Hello world"))
    assert index == 4
    assert checker.finalize(seq)[1] == "Hel"


def test_a_stop_string_in_the_prompt_does_not_stop(tokenizer, checker):
    seq = new_seq(tokenizer, prompt="say STOP", stop=("STOP",), max_new_tokens=5)
    index, reason = feed(checker, seq, encode(tokenizer, "hello"))
    assert (index, reason) == (4, FinishReason.LENGTH)
    assert checker.finalize(seq)[1] == "hello"


def test_multibyte_stop_string(tokenizer, checker):
    seq = new_seq(tokenizer, stop=("é!",), max_new_tokens=100)
    index, reason = feed(checker, seq, encode(tokenizer, "un café! encore"))
    assert reason is FinishReason.STOP and index == len("un café!".encode()) - 1
    assert checker.finalize(seq)[1] == "un caf"


def test_long_stop_string_spanning_many_tokens(tokenizer, checker):
    stop = "the end of the story"
    seq = new_seq(tokenizer, stop=(stop,), max_new_tokens=200)
    text = "x" * 50 + stop + " epilogue"
    index, reason = feed(checker, seq, encode(tokenizer, text))
    assert reason is FinishReason.STOP and index == 50 + len(stop) - 1
    assert checker.finalize(seq)[1] == "x" * 50


def test_eos_stops_and_is_kept_in_the_tokens_not_the_text(tokenizer, checker):
    seq = new_seq(tokenizer, max_new_tokens=10)
    index, reason = feed(checker, seq, encode(tokenizer, "ab") + [EOS] + encode(tokenizer, "cd"))
    assert (index, reason) == (2, FinishReason.STOP)
    token_ids, text = checker.finalize(seq)
    assert token_ids == encode(tokenizer, "ab") + [EOS] and text == "ab"


def test_eos_on_the_last_allowed_token_is_a_stop(tokenizer, checker):
    seq = new_seq(tokenizer, max_new_tokens=3)
    assert feed(checker, seq, encode(tokenizer, "ab") + [EOS]) == (2, FinishReason.STOP)


def test_ignore_eos_continues_to_max_new_tokens(tokenizer, checker):
    seq = new_seq(tokenizer, max_new_tokens=6, ignore_eos=True)
    tokens = [EOS, *encode(tokenizer, "ab"), EOS, EOS, *encode(tokenizer, "c"), EOS]
    assert feed(checker, seq, tokens) == (5, FinishReason.LENGTH)
    token_ids, text = checker.finalize(seq)
    assert token_ids == tokens[:6] and text == "abc"


def test_max_new_tokens_is_length(tokenizer, checker):
    seq = new_seq(tokenizer, max_new_tokens=4)
    assert feed(checker, seq, encode(tokenizer, "abcdefgh")) == (3, FinishReason.LENGTH)
    assert checker.finalize(seq) == (encode(tokenizer, "abcd"), "abcd")


def test_context_length_is_length(tokenizer):
    checker = StopChecker(tokenizer, [EOS], max_model_len=10)
    seq = new_seq(tokenizer, prompt="1234567", max_new_tokens=100)
    assert feed(checker, seq, encode(tokenizer, "abcdef")) == (2, FinishReason.LENGTH)
    assert seq.num_tokens == 10


def test_several_eos_ids(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    checker = StopChecker(tokenizer, [EOS, im_end], max_model_len=512)
    seq = new_seq(tokenizer, max_new_tokens=10)
    assert feed(checker, seq, encode(tokenizer, "ok") + [im_end, EOS]) == (2, FinishReason.STOP)


# ---- through the engine, with a tiny model -------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads on a shared machine
    yield make_tiny_model("llama", seed=0)
    torch.set_num_threads(previous)


def generate(model, tokenizer, params: SamplingParams, *, eos_token_ids: list[int],
             prompt: str = "Once upon a time", **config):
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(num_kv_blocks=64, **config),
                       eos_token_ids=eos_token_ids)
    [completion] = engine.generate([Request("r", encode(tokenizer, prompt), params)])
    return completion


@pytest.fixture(scope="module")
def free_run(model, tokenizer):
    """40 greedy tokens with no EOS and no stop string."""
    completion = generate(model, tokenizer, SamplingParams(max_new_tokens=40), eos_token_ids=[])
    assert completion.finish_reason is FinishReason.LENGTH and len(completion.token_ids) == 40
    return completion


def ascii_pairs(tokenizer, token_ids: list[int]) -> list[tuple[int, str]]:
    """(index of the second token, text) of each two printable ASCII bytes in a row."""
    chars = [tokenizer.decode([t]) for t in token_ids]
    return [(i, chars[i - 1] + chars[i]) for i in range(1, len(chars))
            if all(len(c) == 1 and c.isascii() and c.isprintable() for c in chars[i - 1:i + 1])]


def test_engine_cuts_at_a_stop_string(model, tokenizer, free_run):
    pairs = [(i, s) for i, s in ascii_pairs(tokenizer, free_run.token_ids) if i >= 3]
    assert pairs, "the free run has no ASCII text to stop on"
    stop = pairs[0][1]
    completion = generate(model, tokenizer, SamplingParams(max_new_tokens=40, stop=(stop,)), eos_token_ids=[])
    assert completion.finish_reason is FinishReason.STOP
    assert completion.text == free_run.text[:free_run.text.find(stop)]
    # the tokens end with the one that completes the first occurrence
    end = min(i for i, s in ascii_pairs(tokenizer, free_run.token_ids) if s == stop)
    assert completion.token_ids == free_run.token_ids[:end + 1]


def test_engine_earliest_of_several_stop_strings_wins(model, tokenizer, free_run):
    pairs = ascii_pairs(tokenizer, free_run.token_ids)
    distinct = list(dict.fromkeys(s for _, s in pairs))
    assert len(distinct) >= 2
    early, late = distinct[0], distinct[-1]
    params = SamplingParams(max_new_tokens=40, stop=(late, early))
    completion = generate(model, tokenizer, params, eos_token_ids=[])
    assert completion.text == free_run.text[:free_run.text.find(early)]


def test_engine_eos_stop_and_ignore_eos(model, tokenizer, free_run):
    tokens = free_run.token_ids
    # an EOS id the model emits at position p (and not before)
    p = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    eos = tokens[p]
    stopped = generate(model, tokenizer, SamplingParams(max_new_tokens=40), eos_token_ids=[eos])
    assert stopped.finish_reason is FinishReason.STOP and stopped.token_ids == tokens[:p + 1]

    ignored = generate(model, tokenizer, SamplingParams(max_new_tokens=40, ignore_eos=True),
                       eos_token_ids=[eos])
    assert ignored.finish_reason is FinishReason.LENGTH
    assert ignored.token_ids == tokens and eos in ignored.token_ids[:-1]


def test_engine_max_new_tokens_is_length(model, tokenizer, free_run):
    completion = generate(model, tokenizer, SamplingParams(max_new_tokens=7), eos_token_ids=[])
    assert completion.finish_reason is FinishReason.LENGTH
    assert completion.token_ids == free_run.token_ids[:7]
    assert completion.text == tokenizer.decode(free_run.token_ids[:7])


def test_engine_context_length_is_length(model, tokenizer, free_run):
    prompt = "Once upon a time"  # 16 tokens
    completion = generate(model, tokenizer, SamplingParams(max_new_tokens=40), eos_token_ids=[],
                          prompt=prompt, max_model_len=21)
    assert completion.finish_reason is FinishReason.LENGTH
    assert completion.token_ids == free_run.token_ids[:5]
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(num_kv_blocks=64, max_model_len=16))
    with pytest.raises(RequestRejected):
        engine.add_request(Request("r", encode(tokenizer, prompt), SamplingParams(max_new_tokens=1)))


def test_engine_default_eos_ids_come_from_the_model_and_tokenizer(model, tokenizer):
    engine = LLMEngine(copy.deepcopy(model), tokenizer, EngineConfig(num_kv_blocks=8))
    assert engine.stop_checker.eos_token_ids == {EOS}
