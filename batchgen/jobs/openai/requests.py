"""One OpenAI Batch API request (a row of batchgen.io.inputs.openai_batch) -> a planned row, or an error row.

Supported: `POST /v1/chat/completions` (body `messages`) and `POST /v1/completions` (body
`prompt`), with the body fields that decide generation, each per request (an embed job's
`POST /v1/embeddings` requests: batchgen.jobs.openai.embeddings):

    max_completion_tokens / max_tokens   the row's max_new_tokens (absent: the job's --max-new-tokens)
    temperature [0, 2], top_p (0, 1], presence_penalty / frequency_penalty [-2, 2]
    seed                                 the row's sampling seed, as given (absent: derived from --seed)
    stop                                 a string or up to 4 (absent: the job's --stop)
    logit_bias                           {token id: bias in [-100, 100]}, as the API takes it
    top_k, repetition_penalty, min_tokens, allowed_token_ids  vLLM's extensions of the same API
    logprobs, top_logprobs               chat: logprobs true and top_logprobs 0-20 alternatives;
                                         completions: logprobs 0-20 alternatives (the response's shapes)
    response_format                      text, json_object or json_schema: constrained decoding
                                         (batchgen.jobs.openai.response_format)
    n (1 only), stream / echo (false only), best_of (1 only)
    model, user, metadata, store, service_tier  recorded or ignored: they do not change the text

A field the body does not set takes the job's setting (so `--temperature 1` gives the API's own
default; batchgen's is greedy). `model` never switches models: the job runs its --model for every
request and the `model` column records what the request asked for; a `model` naming one of the
job's --lora adapters runs that adapter on the job's model (batchgen.jobs.rows.row_adapter). Anything else (tools,
images, ...) is refused for that request alone: an error
row whose message carries the API's error code (batchgen.io.inputs.openai_batch.api_error). Prompts
are never cut to fit: as the API does, a request too long for the context is an error
(context_length_exceeded), whatever --on-long-prompt says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchgen.config.choices import MAX_LOGPROBS, MAX_SAMPLES
from batchgen.config.constraint import Constraint
from batchgen.config.job import JobConfig
from batchgen.config.token_controls import read_logit_bias, read_token_ids
from batchgen.io.inputs.openai_batch import CHAT_URL, COMPLETIONS_URL
from batchgen.jobs.openai.body_fields import check_text as _check_text
from batchgen.jobs.openai.body_fields import number as _number
from batchgen.jobs.openai.body_fields import request_body as _body
from batchgen.jobs.openai.embeddings import prepare_embeddings_row
from batchgen.jobs.openai.response_format import response_format_constraint
from batchgen.jobs.prompting.chat_rows import MESSAGE_ROLES
from batchgen.jobs.prompting.prompts import PromptBuilder
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.request_error import RequestError
from batchgen.jobs.rows.row_adapter import adapter_identity, request_adapter
from batchgen.jobs.rows.rows import InputRow

URLS = (CHAT_URL, COMPLETIONS_URL)
MAX_STOP_STRINGS = 4  # the API's limit
# body fields that do not change the generated text: accepted and not used (model is recorded)
IGNORED_FIELDS = ("model", "user", "metadata", "store", "service_tier")
# fields accepted only at the value that means "off"
OFF_VALUES: dict[str, tuple[Any, ...]] = {"best_of": (1,), "stream": (False,), "echo": (False,)}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "min_tokens", "logit_bias", "allowed_token_ids")
COMMON_FIELDS = {*IGNORED_FIELDS, *OFF_VALUES, *SAMPLING_FIELDS, "n", "max_tokens", "seed", "stop", "logprobs",
                 "response_format"}
FIELDS_BY_URL = {CHAT_URL: COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"},
                 COMPLETIONS_URL: COMMON_FIELDS | {"prompt"}}


@dataclass(slots=True)
class ParsedRequest:
    url: str
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | None = None  # completions
    max_new_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # row_sampling's keys
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    logprobs: int | None = None  # alternatives per token; None = no logprobs
    constraint: Constraint | None = None  # from response_format; None = free text
    model: Any = None  # the body's model: a loaded --lora adapter's name selects it


def parse_request(values: dict[str, Any]) -> ParsedRequest:
    """Check one request row (method, url, body) and read what it asks for; RequestError if unsupported."""
    method, url = values.get("method"), values.get("url")
    if method != "POST":
        raise RequestError("unsupported_method", f"method must be POST, got {method!r}", param="method")
    if url not in URLS:
        raise RequestError("unsupported_url", f"url {url!r} is not supported (supported: {', '.join(URLS)})",
                           param="url")
    body = _body(values.get("body"))
    unknown = sorted(k for k in body if k not in FIELDS_BY_URL[url])
    if unknown:
        raise RequestError("unsupported_parameter", f"body field {unknown[0]!r} is not supported by batchgen for "
                           f"{url}", param=unknown[0])
    body = {k: v for k, v in body.items() if v is not None}  # null means the default, as in the API
    for name, allowed in OFF_VALUES.items():
        if name in body and not any(type(body[name]) is type(a) and body[name] == a for a in allowed):
            raise RequestError("unsupported_parameter", f"{name}={json.dumps(body[name])} is not supported "
                               f"(only {json.dumps(allowed[0])})", param=name)
    request = ParsedRequest(url, model=body.get("model"))
    if url == CHAT_URL:
        request.messages = _messages(body.get("messages"))
    else:
        request.prompt = _prompt(body.get("prompt"))
    if "max_completion_tokens" in body and "max_tokens" in body and \
            body["max_completion_tokens"] != body["max_tokens"]:
        raise RequestError("invalid_value", "max_tokens and max_completion_tokens disagree; set one",
                           param="max_completion_tokens")
    for name in ("max_completion_tokens", "max_tokens"):
        if name in body:
            request.max_new_tokens = _number(body, name, integer=True, low=1)
    request.sampling = _sampling(body)
    # n choices: one engine sample each (the row's sample_index = the choice's index); n = 1 is left out
    # of the settings, so rows committed when only n = 1 was accepted keep their prompt hashes
    if "n" in body and (n := _number(body, "n", integer=True, low=1, high=MAX_SAMPLES)) > 1:
        request.sampling["n"] = n
    if "seed" in body:
        request.seed = _number(body, "seed", integer=True) % (1 << 63)  # the engine's seeds are int63
    if "stop" in body:
        request.stop = _stop(body["stop"])
    request.logprobs = _logprobs(body, url)
    if "response_format" in body:
        request.constraint = response_format_constraint(body["response_format"])
    return request


def prepare_request_row(row: InputRow, builder: PromptBuilder, config: JobConfig) -> PlannedRow:
    """A Batch API request row -> prompt ids and per-row settings; RowError (coded) for an error row.
    An embed job's rows are /v1/embeddings requests (batchgen.jobs.openai.embeddings)."""
    if config.task == "embed":
        return prepare_embeddings_row(row, builder, config)
    request = parse_request(row.values)
    max_new = request.max_new_tokens or config.max_new_tokens
    if request.messages is not None:
        if not builder.chat:
            raise RequestError("invalid_request", f"{CHAT_URL} needs a chat template, and this model's tokenizer "
                               f"has none; send {COMPLETIONS_URL} requests instead")
        try:
            ids = builder.chat_token_ids(request.messages)
        except Exception as e:  # a template that refuses a conversation (roles out of order, ...)
            raise RequestError("invalid_request", f"the model's chat template failed on these messages: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", param="messages") from None
    else:
        parse = config.parse_special_tokens if config.parse_special_tokens is not None else True
        ids = builder.text_token_ids(request.prompt, parse_special_tokens=parse)
    room = builder.max_context_tokens - max_new
    if builder.max_prompt_tokens is not None:
        room = min(room, builder.max_prompt_tokens)
    if len(ids) > room:
        raise RequestError("context_length_exceeded", f"the prompt has {len(ids)} tokens and {max_new} are asked "
                           f"for, but the context of {builder.max_context_tokens} tokens leaves room for "
                           f"{max(room, 0)} prompt tokens", param="messages" if request.messages else "prompt")
    settings = {"max_tokens": request.max_new_tokens, "sampling": request.sampling, "seed": request.seed,
                "stop": request.stop}
    if request.logprobs is not None:  # only when asked: the hashes of rows committed before keep their value
        settings["logprobs"] = request.logprobs
    if request.constraint is not None:  # likewise
        settings["constraint"] = request.constraint.describe()
    adapter = request_adapter(request.model, config)
    if adapter is not None:  # likewise
        settings["adapter"] = adapter_identity(adapter, config)
    return PlannedRow(row, ids, max_new, sampling=request.sampling or None, seed=request.seed, stop=request.stop,
                      logprobs=request.logprobs, constraint=request.constraint,
                      settings_key=json.dumps(settings, sort_keys=True), adapter=adapter)


def _logprobs(body: dict[str, Any], url: str) -> int | None:
    """Chat: `logprobs: true` with `top_logprobs` alternatives (0 when absent); completions: the
    integer `logprobs` is the number of alternatives. None: the request asks for none."""
    if url == CHAT_URL:
        asked = body.get("logprobs", False)
        if not isinstance(asked, bool):
            raise RequestError("invalid_value", f"logprobs must be true or false, got {json.dumps(asked)[:40]}",
                               param="logprobs")
        if "top_logprobs" in body and not asked:
            raise RequestError("invalid_value", "top_logprobs needs logprobs: true", param="top_logprobs")
        if not asked:
            return None
        return _number(body, "top_logprobs", integer=True, low=0, high=MAX_LOGPROBS) if "top_logprobs" in body else 0
    if "logprobs" not in body or body["logprobs"] is False:
        return None
    return _number(body, "logprobs", integer=True, low=0, high=MAX_LOGPROBS)


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("invalid_request", "messages must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError("invalid_value", f"{where} must be an object", param=where)
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise RequestError("unsupported_parameter", f"{where}.{unknown[0]} is not supported", param=where)
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError("unsupported_parameter" if isinstance(role, str) else "invalid_value",
                               f"{where}.role {role!r} is not supported (supported: {', '.join(MESSAGE_ROLES)})",
                               param=f"{where}.role")
        out.append({"role": MESSAGE_ROLES[role], "content": _content(message.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError("unsupported_parameter", f"{where}.content: only text parts are supported, "
                                   f"got {kind!r}", param=f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError("invalid_value", f"{where}.content must be a string or text parts", param=f"{where}.content")
    _check_text(content, f"{where}.content")
    return content


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("unsupported_parameter" if isinstance(prompt, list) else "invalid_request",
                           "prompt must be a string (or an array of one string)", param="prompt")
    if not prompt.strip():
        raise RequestError("invalid_prompt", "prompt is empty or whitespace only", param="prompt")
    _check_text(prompt, "prompt")
    return prompt


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_STRINGS):
        raise RequestError("invalid_value", f"stop must be a non-empty string or an array of at most "
                           f"{MAX_STOP_STRINGS} of them", param="stop")
    return tuple(stops)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limits = {"temperature": (0.0, 2.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
    for name, (low, high) in limits.items():
        if name in body:
            out[name] = _number(body, name, low=low, high=high)
    if "top_p" in body:
        out["top_p"] = _number(body, "top_p", high=1.0)
        if out["top_p"] <= 0:
            raise RequestError("invalid_value", f"top_p must be in (0, 1], got {out['top_p']}", param="top_p")
    if "top_k" in body:
        top_k = _number(body, "top_k", integer=True, low=-1)
        if top_k == 0:
            raise RequestError("invalid_value", "top_k must be >= 1, or -1 for no limit", param="top_k")
        if top_k > 0:  # -1: vLLM's "no limit", the job's setting stands
            out["top_k"] = top_k
    if "repetition_penalty" in body:
        out["repetition_penalty"] = _number(body, "repetition_penalty")
        if out["repetition_penalty"] <= 0:
            raise RequestError("invalid_value", "repetition_penalty must be > 0", param="repetition_penalty")
    if "min_tokens" in body:
        out["min_tokens"] = _number(body, "min_tokens", integer=True, low=0)
    for name, read in (("logit_bias", read_logit_bias), ("allowed_token_ids", read_token_ids)):
        if name in body:
            controls = read(body[name], lambda m, name=name: RequestError("invalid_value", m, param=name), name)
            if controls:
                out[name] = controls
    return out
