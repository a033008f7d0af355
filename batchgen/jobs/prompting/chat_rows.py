"""A prompt column of chat messages: the row's conversation goes through the model's chat template.

A chat dataset holds each row's conversation as a list of {"role", "content"} objects: a Parquet
list<struct<role, content>> column, or a JSON Lines array. With no --template, such a prompt
cell is the conversation itself, rendered by the chat template as an OpenAI Batch request's
`messages` are (PromptBuilder.chat_token_ids: each content is data, special-token text split),
the same for both formats. Roles: system (or developer), user, assistant; a content is a string
or a list of text parts. --system is put first where the conversation has no system message. A
conversation is never cut to fit: one too long for the context is an error row, whatever
--on-long-prompt says (which part of a dialogue could go is not ours to guess). Anything else
(another role or key, a model without a chat template) makes the row an error row; under
--template a column of messages is no text (batchgen.jobs.rows.rows).
"""

from __future__ import annotations

from typing import Any

from batchgen.jobs.prompting.prompts import PromptBuilder, RowError

MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def is_conversation(value: Any) -> bool:
    """A non-empty list of objects that all have a role and a content: what a messages column holds."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def conversation_token_ids(messages: list[dict[str, Any]], builder: PromptBuilder, *, column: str,
                           system: str | None, max_new_tokens: int) -> list[int]:
    """The conversation's prompt token ids; RowError (an error row) for one that cannot be used."""
    label = f"prompt column {column!r}"
    if not builder.chat:
        raise RowError(f"{label} holds chat messages, which need the model's chat template (this job has none, "
                       "or --no-chat)", column=column)
    checked = [_message(m, i, label, column) for i, m in enumerate(messages)]
    if system is not None and checked[0]["role"] != "system":
        checked.insert(0, {"role": "system", "content": system})
    try:
        ids = builder.chat_token_ids(checked)
    except Exception as e:  # a template that refuses this conversation (roles out of order, ...)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RowError(f"{label}: the model's chat template failed on these messages: {first}", column=column) from None
    room = builder.max_context_tokens - max_new_tokens
    if builder.max_prompt_tokens is not None:
        room = min(room, builder.max_prompt_tokens)
    if len(ids) > room:
        raise RowError(f"{label}: the conversation has {len(ids)} tokens and max_new_tokens {max_new_tokens} leaves "
                       f"room for {max(room, 0)} in the context of {builder.max_context_tokens}; a conversation is "
                       "not cut to fit", column=column)
    return ids


def _message(message: dict[str, Any], i: int, label: str, column: str) -> dict[str, str]:
    where = f"{label}, message {i}"
    extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
    if extra:  # a struct's absent fields read as null: only keys with a value count
        raise RowError(f"{where}: key {extra[0]!r} is not supported (role and content only)", column=column)
    role = message["role"]
    if role not in MESSAGE_ROLES:
        raise RowError(f"{where}: role {role!r} is not supported (supported: {', '.join(MESSAGE_ROLES)})",
                       column=column)
    content = message["content"]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)  # content parts: text only
    if not isinstance(content, str):
        raise RowError(f"{where}: content must be text, got {type(content).__name__}", column=column)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(f"{where}: content holds text that is not valid Unicode (at character {e.start})",
                       column=column) from None
    return {"role": MESSAGE_ROLES[role], "content": content}
