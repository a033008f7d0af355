"""A document far longer than the context is cut to a prefix before it is tokenized, and the prompt
is exactly what tokenizing the whole of it gave: cut at the same token, the same ids."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from batchgen.jobs.prompting.prompts import PromptBuilder, RowError, Template
from batchgen.jobs.prompting.token_chars import max_chars_per_token
from tests.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, make_tokenizer

CORPUS = ["the cat sat on the mat; der Hund läuft über die Straße. 数据 123456 --- ####   \n\n" * 3,
          "def f(x):\n    return x ** 2  # éé ü 😀", "aaaa bbbb aaaa bbbb " * 10]


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with real merges (multi-character tokens), trained here in a few ms."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


class Recording:
    """A tokenizer that remembers the longest text it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def merging():
    return merging_tokenizer()


def builder(tokenizer, template="Summarize: {text}\nEnd.", *, chat=True, max_prompt_tokens=64,
            on_long_prompt="truncate", cut=True):
    b = PromptBuilder(tokenizer, Template(template, "text"), system=None, chat=chat, max_context_tokens=4096,
                      max_prompt_tokens=max_prompt_tokens, on_long_prompt=on_long_prompt)
    if not cut:  # as before the bound: every prompt tokenized whole
        b._chars_per_token = None
    return b


def test_a_long_document_is_cut_before_it_is_tokenized(merging):
    doc = "".join(CORPUS) * 2_000  # ~290,000 characters
    recording = Recording(merging)
    built = builder(recording).build({"text": doc}, 16)
    assert recording.longest < 30_000, "the whole document was tokenized"
    whole = builder(merging, cut=False).build({"text": doc}, 16)
    assert built.token_ids == whole.token_ids and len(built.token_ids) <= 64
    assert built.num_truncated_tokens > 0
    with pytest.raises(RowError, match=r"prompt has more than 64 tokens \(\d+ characters\)"):
        builder(recording, on_long_prompt="error").build({"text": doc}, 16)


@settings(max_examples=40, deadline=None)
@given(piece=st.text(min_size=1, max_size=40).filter(lambda s: not s.isspace()),
       repeats=st.integers(1, 400), max_prompt_tokens=st.integers(8, 40), chat=st.booleans(),
       template=st.sampled_from(["{text}", "Q: {text}\nA:", "{text} | {text}"]), merges=st.booleans())
def test_cut_prompts_equal_whole_ones(merging, piece, repeats, max_prompt_tokens, chat, template, merges):
    tokenizer = merging if merges else make_tokenizer()
    row = {"text": piece * repeats}
    results = []
    for cut in (True, False):
        try:
            built = builder(tokenizer, template, chat=chat, max_prompt_tokens=max_prompt_tokens, cut=cut).build(row, 4)
            results.append((built.token_ids, built.num_truncated_tokens > 0))
        except RowError as e:
            results.append(("error", e.column))
    assert results[0] == results[1]


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=300))
def test_no_token_covers_more_characters_than_the_bound(merging, text):
    for tokenizer in (merging, make_tokenizer()):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(text) <= max_chars_per_token(tokenizer) * len(ids)


def _with(tokenizer, **parts):
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    backend = Tokenizer.from_str(json.dumps(spec))
    for name, value in parts.items():
        setattr(backend, name, value)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_the_bound_is_given_only_where_the_tokenizer_proves_it(merging):
    longest = max(len(t) for t in merging.get_vocab())
    assert max_chars_per_token(merging) == longest
    tiny = make_tokenizer()
    assert max_chars_per_token(tiny) == len("<|im_start|>")  # its longest token: a special one
    tiny.add_tokens(["a-very-long-added-token-of-forty-chars!!"])
    assert max_chars_per_token(tiny) == 40  # read again, not the bound remembered for this tokenizer
    assert max_chars_per_token(_with(merging, normalizer=normalizers.NFKC())) == 4 * longest
    assert max_chars_per_token(_with(merging, normalizer=normalizers.Replace("...", "…"))) == 3 * longest
    for dropping in (dict(normalizer=normalizers.Strip()), dict(normalizer=normalizers.StripAccents()),
                     dict(normalizer=normalizers.Replace(" ", "")),
                     dict(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
                     dict(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed"))):
        assert max_chars_per_token(_with(merging, **dropping)) is None, dropping
    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=word_piece)) is None
    assert max_chars_per_token(object()) is None  # a slow tokenizer: no backend to read
