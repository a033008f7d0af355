"""Row -> prompt token ids: templates, value checks, chat templates and truncation to the context.

The tokenizer fixture is byte-level (one token per UTF-8 byte), so token counts are byte counts.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.errors import ConfigError
from batchgen.jobs.prompting.prompts import BuiltPrompt, PromptBuilder, RowError, Template, row_max_new_tokens
from tests.tiny import make_tokenizer

CHAT_HEAD = "<|im_start|>user\n"
CHAT_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def plain_tokenizer():
    return make_tokenizer(chat=False)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


# --- Template -----------------------------------------------------------------------------------

def test_no_template_uses_prompt_column_alone():
    t = Template(None, "text")
    assert t.columns == ["text"] and t.document_column == "text"
    assert t.render({"text": "hello", "other": "x"}) == "hello"


def test_template_with_several_columns():
    t = Template("Title: {title}\nBody: {text}\nAgain {title} by {author name}", "text")
    assert t.columns == ["title", "text", "author name"]
    assert t.document_column == "text"
    row = {"title": "T", "text": "B", "author name": "A-b"}
    assert t.render(row) == "Title: T\nBody: B\nAgain T by A-b"


def test_document_column_is_last_placeholder_without_prompt_column():
    assert Template("{a} then {b-c}", "text").document_column == "b-c"


def test_literal_braces():
    t = Template("{{x}} {{{text}}} }}{{", "text")
    assert t.columns == ["text"]
    assert t.render({"text": "v"}) == "{x} {v} }{"


def test_values_are_never_evaluated_or_substituted_again():
    t = Template("{text}|{meta}", "text")
    row = {"text": "{meta} {0.__class__} {__import__('os')}", "meta": "{text}"}
    assert t.render(row) == "{meta} {0.__class__} {__import__('os')}|{text}"


@pytest.mark.parametrize("text", [
    "{text", "text}", "a } b {text}", "{a{text}}", "{}", "{ }", "{a.b}", "{a!r}", "{a:>10}",
    "{a[0]}", "{x.__class__}", "{ text }", "{a\nb}", "no placeholder at all", "",
])
def test_malformed_template_is_config_error(text):
    with pytest.raises(ConfigError, match="template"):
        Template(text, "text")


def test_check_columns_lists_existing_columns():
    t = Template("{title}: {text}", "text")
    t.check_columns(["text", "title", "id"], "in.parquet")
    with pytest.raises(ConfigError) as e:
        t.check_columns(["text", "id"], "in.parquet")
    assert str(e.value) == ("in.parquet: template names column 'title', which does not exist; "
                            "columns: text, id")
    with pytest.raises(ConfigError, match="columns 'title', 'text', which do not exist"):
        t.check_columns(["id"], "in.parquet")


@pytest.mark.parametrize("value, message", [
    (None, "prompt column 'text' is null"),
    ("", "prompt column 'text' is empty"),
    (" \n\t", "prompt column 'text' is whitespace only"),
    (["a"], "prompt column 'text' holds a list, not text"),
    ({"a": 1}, "prompt column 'text' holds a dict, not text"),
    (b"abc", "prompt column 'text' holds a bytes, not text"),
    ("ok \ud800 no", "prompt column 'text' holds text that is not valid Unicode"),
])
def test_bad_document_values_are_row_errors(value, message):
    with pytest.raises(RowError, match=message) as e:
        Template("Q: {text}", "text").render({"text": value})
    assert e.value.column == "text" and "\n" not in str(e.value)


def test_other_columns_take_scalars_and_may_be_empty():
    t = Template("{n} {f} {b} [{empty}] {text}", "text")
    assert t.render({"n": 3, "f": 1.5, "b": True, "empty": "", "text": "x"}) == "3 1.5 True [] x"
    assert Template("{text}", "text").render({"text": 42}) == "42"


@pytest.mark.parametrize("row, message", [
    ({"title": None, "text": "x"}, "column 'title' is null"),
    ({"title": [1], "text": "x"}, "column 'title' holds a list"),
    ({"title": "\udfff", "text": "x"}, "column 'title' holds text that is not valid Unicode"),
    ({"text": "x"}, "column 'title' is missing from this row"),
])
def test_bad_other_values_are_row_errors(row, message):
    with pytest.raises(RowError, match=message):
        Template("{title}: {text}", "text").render(row)


# --- PromptBuilder: chat --------------------------------------------------------------------------

def builder(tokenizer, template="{text}", *, system=None, chat=None, max_context_tokens=512,
            on_long_prompt="truncate"):
    return PromptBuilder(tokenizer, Template(template, "text"), system=system, chat=chat,
                         max_context_tokens=max_context_tokens, on_long_prompt=on_long_prompt)


def test_plain_prompt_without_chat(tokenizer, plain_tokenizer):
    for tok in (tokenizer, plain_tokenizer):
        built = builder(tok, "Say: {text}", chat=False).build({"text": "héllo"}, 16)
        assert built == BuiltPrompt(tok("Say: héllo")["input_ids"], 0)
        assert decode(tok, built.token_ids) == "Say: héllo"


def test_chat_auto_follows_the_tokenizer(tokenizer, plain_tokenizer):
    assert builder(tokenizer).chat is True
    assert builder(plain_tokenizer).chat is False
    built = builder(tokenizer).build({"text": "hi"}, 16)
    assert decode(tokenizer, built.token_ids) == CHAT_HEAD + "hi" + CHAT_TAIL
    # The chat template's specials are single tokens, not their spelled-out bytes.
    assert built.token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_system_prompt_in_chat(tokenizer):
    built = builder(tokenizer, system="Be brief.").build({"text": "hi"}, 16)
    assert decode(tokenizer, built.token_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n" + CHAT_HEAD + "hi" + CHAT_TAIL)


def test_chat_without_chat_template_is_config_error(plain_tokenizer):
    with pytest.raises(ConfigError, match="no chat template; pass --no-chat"):
        builder(plain_tokenizer, chat=True)


def test_system_prompt_without_chat_is_config_error(tokenizer, plain_tokenizer):
    with pytest.raises(ConfigError, match="system prompt needs the chat template"):
        builder(tokenizer, system="s", chat=False)
    with pytest.raises(ConfigError, match="system prompt needs the chat template"):
        builder(plain_tokenizer, system="s")


def test_chat_template_that_rejects_the_messages_fails_at_start():
    tok = make_tokenizer()
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
                         "not supported') }}{% endif %}{{ messages[0]['content'] }}")
    builder(tok)  # fine without a system prompt
    with pytest.raises(ConfigError, match="System role not supported"):
        builder(tok, system="s")


def test_invalid_settings_are_config_errors(tokenizer):
    with pytest.raises(ConfigError, match="on_long_prompt"):
        builder(tokenizer, on_long_prompt="drop")
    with pytest.raises(ConfigError, match="max_context_tokens"):
        builder(tokenizer, max_context_tokens=0)


# --- PromptBuilder: length ------------------------------------------------------------------------

TEMPLATE = "Summarize the document.\n{text}\nEnd of document."
INSTRUCTION, ENDING = "Summarize the document.\n", "\nEnd of document."


@pytest.mark.parametrize("chat", [True, False])
def test_truncation_cuts_only_the_document_and_fits_exactly(tokenizer, chat):
    doc = "".join(f"word{i} " for i in range(200))
    b = builder(tokenizer, TEMPLATE, chat=chat, max_context_tokens=300)
    built = b.build({"text": doc}, 100)
    assert len(built.token_ids) == 200  # byte tokens: the first estimate is exact
    text = decode(tokenizer, built.token_ids)
    head = (CHAT_HEAD if chat else "") + INSTRUCTION
    tail = ENDING + (CHAT_TAIL if chat else "")
    assert text.startswith(head) and text.endswith(tail)
    kept = text[len(head):len(text) - len(tail)]
    assert kept and doc.startswith(kept) and len(kept) < len(doc)
    assert built.num_truncated_tokens == len(doc.encode()) - len(kept.encode())


def test_truncation_never_splits_a_character(tokenizer):
    doc = "é" * 300  # two bytes (tokens) each
    for max_context_tokens in (200, 201):
        built = builder(tokenizer, TEMPLATE, max_context_tokens=max_context_tokens).build({"text": doc}, 50)
        assert len(built.token_ids) <= max_context_tokens - 50
        text = decode(tokenizer, built.token_ids)
        assert "\ufffd" not in text and text.endswith(ENDING + CHAT_TAIL)
        assert built.num_truncated_tokens % 2 == 0 and built.num_truncated_tokens > 0


def test_truncation_with_document_used_twice(tokenizer):
    b = builder(tokenizer, "{text}\n---\n{text}", chat=False, max_context_tokens=100)
    built = b.build({"text": "abcdefghij" * 20}, 10)
    first, second = decode(tokenizer, built.token_ids).split("\n---\n")
    assert first == second and len(built.token_ids) == 89 and built.num_truncated_tokens == 200 - 42


def test_truncation_with_a_tokenizer_without_offsets(tokenizer):
    class NoOffsets:  # what a slow (Python) tokenizer offers: no offset mapping
        is_fast = False
        chat_template = tokenizer.chat_template

        def __call__(self, text, **kw):
            assert "return_offsets_mapping" not in kw
            return tokenizer(text, **kw)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    built = builder(NoOffsets(), TEMPLATE, max_context_tokens=120).build({"text": "xyz " * 100}, 20)
    assert len(built.token_ids) == 100 and built.num_truncated_tokens > 0
    assert decode(tokenizer, built.token_ids).endswith(ENDING + CHAT_TAIL)


def test_long_prompt_error_policy(tokenizer):
    b = builder(tokenizer, chat=False, max_context_tokens=50, on_long_prompt="error")
    assert len(b.build({"text": "a" * 40}, 10).token_ids) == 40
    with pytest.raises(RowError) as e:
        b.build({"text": "a" * 41}, 10)
    assert str(e.value) == ("prompt has 41 tokens; the model's context of 50 tokens minus "
                            "max_new_tokens 10 leaves room for 40")


def test_template_alone_too_long_is_row_error(tokenizer):
    b = builder(tokenizer, TEMPLATE, chat=False, max_context_tokens=60)
    with pytest.raises(RowError, match="without column 'text' already has 41") as e:
        b.build({"text": "a" * 100}, 20)  # 41 tokens of template, room for 40
    assert e.value.column == "text"
    assert len(b.build({"text": "a" * 100}, 18).token_ids) == 42  # room for one


def test_document_cut_to_blanks_is_row_error(tokenizer):
    b = builder(tokenizer, "Q:{text}", chat=False, max_context_tokens=30)
    with pytest.raises(RowError, match="too little room"):
        b.build({"text": " " * 40 + "words"}, 10)


def test_max_new_tokens_filling_the_context_is_row_error(tokenizer):
    b = builder(tokenizer, max_context_tokens=64)
    for max_new_tokens in (64, 100):
        with pytest.raises(RowError, match=f"max_new_tokens {max_new_tokens} leaves no room for the "
                                           "prompt in the model's context of 64 tokens"):
            b.build({"text": "hi"}, max_new_tokens)


@settings(max_examples=60, deadline=None)
@given(doc=st.text(min_size=1, max_size=120).filter(lambda s: not s.isspace()),
       max_context_tokens=st.integers(1, 150), chat=st.booleans())
def test_every_row_fits_or_is_a_row_error(tokenizer, doc, max_context_tokens, chat):
    b = builder(tokenizer, "Q:{text}!", chat=chat, max_context_tokens=max_context_tokens)
    try:
        built = b.build({"text": doc}, 8)
    except RowError:
        return
    assert len(built.token_ids) <= max_context_tokens - 8
    text = decode(tokenizer, built.token_ids)
    assert text.endswith("!" + (CHAT_TAIL if chat else ""))
    kept = text[len((CHAT_HEAD if chat else "") + "Q:"):text.rindex("!")]
    assert doc.startswith(kept) and (built.num_truncated_tokens == 0) == (kept == doc)


# --- row_max_new_tokens ---------------------------------------------------------------------------

@pytest.mark.parametrize("row, expected", [
    ({"n": 64}, 64), ({"n": 64.0}, 64), ({"n": 1}, 1), ({"n": None}, 256), ({}, 256),
])
def test_row_max_new_tokens(row, expected):
    assert row_max_new_tokens(row, "n", 256) == expected
    assert row_max_new_tokens(row, None, 7) == 7


@pytest.mark.parametrize("value", [0, -3, 1.5, float("nan"), float("inf"), True, "64", [64]])
def test_row_max_new_tokens_rejects(value):
    with pytest.raises(RowError, match="column 'n' must hold a positive integer") as e:
        row_max_new_tokens({"n": value}, "n", 256)
    assert e.value.column == "n"
