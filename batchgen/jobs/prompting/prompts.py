"""One input row -> prompt token ids for the engine, or a RowError for that row alone.

The row's text comes from its Template (batchgen.jobs.prompting.template: `{column}` placeholders, never
str.format or Jinja). The model's own chat template (Jinja, from the tokenizer) only ever receives row text as a message
content string.

Data is data: text from the rows is tokenized with special-token parsing off, so a document holding
`<|im_end|>\n<|im_start|>system\n...` stays those characters and can never forge a turn; the chat
template's own special tokens are kept. `parse_special_tokens` (on by default only without the
chat template, where rows are pre-rendered prompts) reads special-token text in rows as tokens.
"""

from __future__ import annotations

import numbers
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchgen.config.job import LONG_PROMPT_POLICIES, JobConfig
from batchgen.config.text_settings import chat_template_text
from batchgen.errors import ConfigError
from batchgen.jobs.prompting.template import RowError, Template
from batchgen.jobs.prompting.token_chars import max_chars_per_token

__all__ = ["BuiltPrompt", "PromptBuilder", "RowError", "Template", "parse_count", "row_max_new_tokens"]

_MAX_TRUNCATION_ROUNDS = 8
_UNKNOWN = object()  # max_chars_per_token not read yet: only a long row needs it


@dataclass(slots=True)
class BuiltPrompt:
    token_ids: list[int]
    # document tokens cut to fit (at least: a long one is cut to a prefix first); 0 when not truncated
    num_truncated_tokens: int


class PromptBuilder:
    """Template + optional chat template + tokenizer -> token ids that fit the context."""

    def __init__(self, tokenizer, template: Template, *, system: str | None, chat: bool | None,
                 max_context_tokens: int, on_long_prompt: str = "truncate",
                 max_prompt_tokens: int | None = None, parse_special_tokens: bool | None = None,
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None):
        # --chat-template: Jinja text replacing the tokenizer's own; its kwargs: extra template variables
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        has_chat_template = bool(chat_template or getattr(tokenizer, "chat_template", None))
        if chat is None:
            chat = has_chat_template
        if chat and not has_chat_template:
            raise ConfigError("the tokenizer of this model has no chat template; pass --no-chat")
        if system is not None and not chat:
            raise ConfigError("a system prompt needs the chat template, which is off for this job "
                              "(no chat template, or --no-chat); put the text in --template instead")
        if on_long_prompt not in LONG_PROMPT_POLICIES:
            raise ConfigError(f"on_long_prompt must be one of {', '.join(LONG_PROMPT_POLICIES)}; "
                              f"got {on_long_prompt!r}")
        if max_context_tokens < 1:
            raise ConfigError(f"max_context_tokens must be positive, got {max_context_tokens}")
        self.tokenizer = tokenizer
        self._chars_per_token: Any = _UNKNOWN
        self.template = template
        self.system = system
        self.chat = chat
        self.max_context_tokens = max_context_tokens
        self.max_prompt_tokens = max_prompt_tokens  # the user's own cap, below the context's
        self.on_long_prompt = on_long_prompt
        self.parse_special_tokens = (not chat) if parse_special_tokens is None else parse_special_tokens
        # the text of every special token: a row that holds none tokenizes the same either way
        self._special_texts = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                                      if t.special} | set(getattr(tokenizer, "all_special_tokens", [])))
        if chat:
            # Render once now: a chat template that rejects our message shape (some refuse a
            # system role) fails the job at start with a config error, not every row.
            try:
                self._tokenize("x")
            except Exception as e:
                raise ConfigError(f"the model's chat template failed on a test message: {e}") from None

    @classmethod
    def for_job(cls, config: JobConfig, tokenizer, template: Template, max_context_tokens: int) -> PromptBuilder:
        """The builder of a job's prompts: every prompt setting of `config`, one place for them all."""
        return cls(tokenizer, template, system=config.system, chat=config.chat, max_context_tokens=max_context_tokens,
                   on_long_prompt=config.on_long_prompt, max_prompt_tokens=config.max_prompt_tokens,
                   parse_special_tokens=config.parse_special_tokens,
                   chat_template=None if config.chat_template is None else chat_template_text(config.chat_template),
                   chat_template_kwargs=config.chat_template_kwargs)

    def build(self, row: Mapping[str, Any], max_new_tokens: int) -> BuiltPrompt:
        max_prompt_tokens = self.max_context_tokens - max_new_tokens
        if max_prompt_tokens < 1:
            raise RowError(f"max_new_tokens {max_new_tokens} leaves no room for the prompt in the "
                           f"model's context of {self.max_context_tokens} tokens")
        if self.max_prompt_tokens is not None:
            max_prompt_tokens = min(max_prompt_tokens, self.max_prompt_tokens)
        text = self.template.render(row)  # every column checked, whether or not the document is cut
        doc = self._document_prefix(row, text, max_prompt_tokens)
        if doc is None:
            token_ids = self._tokenize(text)
            if len(token_ids) <= max_prompt_tokens:
                return BuiltPrompt(token_ids, 0)
            size = f"{len(token_ids)} tokens"
        else:
            token_ids = self._tokenize(self.template.render(row, document_override=doc))
            size = f"more than {max_prompt_tokens} tokens ({len(text)} characters)"
        if self.on_long_prompt == "error":
            raise RowError(f"prompt has {size}; the model's context of "
                           f"{self.max_context_tokens} tokens minus max_new_tokens {max_new_tokens} "
                           f"leaves room for {max_prompt_tokens}")
        return self._truncate(row, token_ids, max_prompt_tokens, size, doc)

    def _document_prefix(self, row: Mapping[str, Any], text: str, max_prompt_tokens: int) -> str | None:
        """The document's first characters where the whole of it cannot fit, else None.

        More than `max_chars_per_token` x (max_prompt_tokens + 1) characters need more tokens than fit
        (batchgen.jobs.prompting.token_chars), so such a prompt is cut whatever its tokens. Twice that
        is kept: a cut to fit keeps at most max_prompt_tokens tokens of the document, far before
        the prefix's end, where the prefix's tokens are the whole document's."""
        if len(text) <= max_prompt_tokens:  # too short to be cut: skip reading the tokenizer's bound
            return None
        if self._chars_per_token is _UNKNOWN:
            self._chars_per_token = max_chars_per_token(self.tokenizer)
        if self._chars_per_token is None:
            return None
        keep_chars = 2 * self._chars_per_token * (max_prompt_tokens + 1)
        doc = self.template.document_value(row)
        return doc[:keep_chars] if len(doc) > keep_chars else None

    def chat_token_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a whole conversation ({"role", "content"} dicts, the OpenAI Batch API's
        messages) through the chat template, the generation prompt added; each content is data, as a
        row's text is (special-token text split unless parse_special_tokens). Not cut to fit."""
        assert self.chat, "the caller checks that the job has a chat template"
        contents = [m["content"] for m in messages]
        if self.parse_special_tokens or not any(self._holds_special_text(c) for c in contents):
            return self._encode(self._render(messages), parse=True)
        # as in _tokenize: render around one marker per message, then tokenize the template's own
        # text with special tokens parsed and each content with them split into plain characters
        markers = [f"\x00batchgen-{uuid.uuid4().hex}\x00" for _ in messages]
        content_of = dict(zip(markers, contents, strict=True))
        rendered = self._render([{**m, "content": marker} for m, marker in zip(messages, markers, strict=True)])
        ids: list[int] = []
        for i, piece in enumerate(re.split("(" + "|".join(map(re.escape, markers)) + ")", rendered)):
            ids += self._encode(content_of[piece], parse=False) if i % 2 else self._encode(piece, parse=True)
        return ids

    def text_token_ids(self, text: str, *, parse_special_tokens: bool) -> list[int]:
        """Token ids of a raw prompt (the Batch API's /v1/completions), BOS and the like added as the
        tokenizer does; no chat template. Not cut to fit."""
        split = not parse_special_tokens and self._holds_special_text(text)
        return list(self.tokenizer(text, add_special_tokens=True, split_special_tokens=split)["input_ids"])

    def _tokenize(self, text: str) -> list[int]:
        """Token ids of the prompt whose row-derived part is `text` (the rendered template)."""
        as_data = not self.parse_special_tokens and self._holds_special_text(text)
        if not self.chat:
            return list(self.tokenizer(text, add_special_tokens=True, split_special_tokens=as_data)["input_ids"])
        messages = [{"role": "system", "content": self.system}] if self.system else []
        if not as_data:
            messages.append({"role": "user", "content": text})
            return self._encode(self._render(messages), parse=True)
        # Render around a marker, then tokenize the template's own text with special tokens
        # parsed and the row's text with them split into plain characters. A row without special
        # text takes the path above, so its tokens are exactly what one whole-text pass gives.
        marker = f"\x00batchgen-{uuid.uuid4().hex}\x00"
        messages.append({"role": "user", "content": marker})
        pieces = self._render(messages).split(marker)
        ids = self._encode(pieces[0], parse=True)
        for piece in pieces[1:]:
            ids += self._encode(text, parse=False) + self._encode(piece, parse=True)
        return ids

    def _render(self, messages: list[dict[str, str]]) -> str:
        # Render to text and tokenize ourselves: apply_chat_template(tokenize=True) returns a
        # BatchEncoding in transformers 5.x but a list in 4.x.
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  chat_template=self.chat_template, **self.chat_template_kwargs)

    def _encode(self, text: str, *, parse: bool) -> list[int]:
        # The rendered text already holds BOS and the like: the tokenizer must not add them again.
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=not parse)["input_ids"])

    def _holds_special_text(self, text: str) -> bool:
        return any(special in text for special in self._special_texts)

    def _truncate(self, row: Mapping[str, Any], token_ids: list[int], max_prompt_tokens: int, size: str,
                  doc: str | None) -> BuiltPrompt:
        """Cut the end of the document column only, so the instruction and chat wrapper survive.
        `doc`: the document's prefix that `token_ids` were built from (None: the whole document), so
        the cut tokens counted are at least that many."""
        doc = self.template.document_value(row) if doc is None else doc
        column = self.template.document_column
        doc_ids, ends = self._document_tokens(doc)
        uses = self.template.document_uses
        # Tokens at the joins can merge differently once the document is cut, so the first cut is
        # an estimate; each further round cuts the measured excess until the prompt fits.
        overhead = len(token_ids) - uses * len(doc_ids)
        keep = min(len(doc_ids) - 1, (max_prompt_tokens - overhead) // uses)
        for _ in range(_MAX_TRUNCATION_ROUNDS):
            cut = ""
            if keep >= 1:
                cut = doc[:ends[keep - 1]] if ends is not None else self.tokenizer.decode(doc_ids[:keep])
            # A prompt whose document is cut to nothing (or to blanks) would still generate, but
            # from the instruction alone: that is an error row, never a silent garbage answer.
            if not cut.strip():
                rest = len(self._tokenize(self.template.render(row, document_override="")))
                raise RowError(f"prompt has {size}; the context leaves room for "
                               f"{max_prompt_tokens}, and the prompt without column {column!r} already "
                               f"has {rest}, leaving too little room for any of it", column=column)
            ids = self._tokenize(self.template.render(row, document_override=cut))
            excess = len(ids) - max_prompt_tokens
            if excess <= 0:
                return BuiltPrompt(ids, len(doc_ids) - keep)
            keep -= max(1, -(-excess // uses))  # the excess spread over the uses, rounded up
        raise RowError(f"could not cut column {column!r} to fit the prompt into {max_prompt_tokens} "
                       f"tokens in {_MAX_TRUNCATION_ROUNDS} tries", column=column)

    def _document_tokens(self, doc: str) -> tuple[list[int], list[int] | None]:
        """The document's token ids and, from fast tokenizers, each token's end in characters.

        Cutting the original string at a token's end keeps the text exact; decoding a cut token
        list instead can leave a broken character (U+FFFD) or altered spacing.
        """
        split = not self.parse_special_tokens
        if getattr(self.tokenizer, "is_fast", False):
            enc = self.tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=split)
            return list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]
        return list(self.tokenizer(doc, add_special_tokens=False, split_special_tokens=split)["input_ids"]), None


def row_max_new_tokens(row: Mapping[str, Any], column: str | None, default: int) -> int:
    """The row's own max_new_tokens from `column`; null (or no column set) means `default`."""
    if column is None:
        return default
    value = row.get(column)
    if value is None:
        return default
    return parse_count(value, column, minimum=1, expected="a positive integer max_new_tokens")


def parse_count(value: Any, column: str, *, minimum: int, expected: str) -> int:
    """A cell holding a whole number >= `minimum` (7 or 7.0, never True); else a RowError that says
    the column must hold `expected`."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        as_float = float(value)
        # is_integer is False for nan and inf too, so those are rejected with fractions.
        if as_float.is_integer() and as_float >= minimum:
            return int(value)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise RowError(f"column {column!r} must hold {expected}, got {shown}", column=column)
