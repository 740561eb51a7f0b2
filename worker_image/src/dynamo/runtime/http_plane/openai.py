"""OpenAI request parsing and response shapes for `/v1/completions` and `/v1/chat/completions`.

Pure functions: the request plane turns an OpenAI body into the engine request's parts with
these and formats engine output back. Every field of the two bodies is honoured, checked
against what the engine publishes (`dynamo.runtime.request_limits`), or refused with a 400
naming it (docs/openai-fields.md has the table): unknown fields too, so nothing a client asks
for is silently dropped.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamo.runtime import request_limits
from dynamo.runtime.errors import RequestError, not_supported
from dynamo.runtime.request_limits import RequestLimits, optional_int


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: `code` is OpenAI's code where it has one (such as
    `context_length_exceeded`), else the HTTP status."""
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        503: "service_unavailable",
    }.get(status, "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def request_error_body(exc: RequestError) -> dict[str, Any]:
    """`error_body` of a `RequestError`."""
    return error_body(str(exc), exc.status, exc.param, exc.code)


# ----- request parsing ---------------------------------------------------------------------

# Fields both routes take, beside the route's own. Each one is honoured, checked against what
# the engine publishes (`RequestLimits`), or refused with a 400 naming it: none is dropped.
_COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "user",
        "logprobs",
        "response_format",
        # vLLM's extensions, which the engines honour too.
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
    }
)
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix"}
# OpenAI fields this worker knows and does not implement, with the value that means "not
# used" (which is accepted).
_REFUSED: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "store": (False,),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "service_tier": ("auto", "default"),
}
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class TextRequest:
    """An OpenAI completions or chat body, checked, as the engine request's parts."""

    chat: bool
    sampling_options: dict[str, Any]
    stop_conditions: dict[str, Any]
    output_options: dict[str, Any]
    stops: list[str]
    stream: bool
    include_usage: bool
    # Alternatives per token when log probabilities were asked for (None: not asked).
    top_logprobs: int | None


def parse_text_request(body: dict[str, Any], limits: RequestLimits, *, chat: bool) -> TextRequest:
    """Check every field of a completions (`chat` False) or chat body; the parts of the
    engine request. The prompt or messages are read apart (`completion_prompt`,
    `chat_messages`); the token-level checks (context, vocabulary, ranges) come once the
    prompt is tokenized (`RequestLimits.check_request`)."""
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for key, value in body.items():
        if key not in known:
            raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)
        if key in _REFUSED and value is not None and value not in _REFUSED[key]:
            raise not_supported(key, limits.engine)
    n = optional_int(body, "n", 1)
    if n not in (None, 1):
        raise RequestError("'n' must be 1: this worker returns one choice", param="n")
    options: dict[str, Any] = {}
    for key in _SAMPLING_KEYS:
        value = _number(body, key)
        if value is not None:
            options[key] = value
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RequestError("'logit_bias' must map token ids to numbers", param="logit_bias")
        if bias:
            options["logit_bias"] = bias
    guided = _guided_decoding(body.get("response_format"), limits)
    if guided is not None:
        options["guided_decoding"] = guided
    max_tokens = max_tokens_of(body, chat=chat)
    stops = stop_strings(body)
    stream = _optional_bool(body, "stream")
    include_usage = _stream_options(body, stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("'user' must be a string", param="user")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("'metadata' must be an object", param="metadata")
    top_logprobs = _logprobs(body, limits, chat=chat)
    output = {"logprobs": top_logprobs} if top_logprobs is not None else {}
    return TextRequest(
        chat=chat,
        sampling_options=options,
        stop_conditions=stop_conditions(body, max_tokens),
        output_options=output,
        stops=stops,
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
    )


def _number(body: dict[str, Any], key: str) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"'{key}' must be a number", param=key)
    return value


def _optional_bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean", param=key)
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether the stream ends with a usage event (`stream_options.include_usage`)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError(
            "'stream_options' may only be set when 'stream' is true", param="stream_options"
        )
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    for key in options:
        if key != "include_usage":
            raise RequestError(
                f"'stream_options.{key}' is not supported (only include_usage)",
                param="stream_options",
            )
    return _optional_bool(options, "include_usage")


def _guided_decoding(response_format: Any, limits: RequestLimits) -> dict[str, Any] | None:
    """`response_format` as the engine's `sampling_options.guided_decoding` (None: text)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in _RESPONSE_FORMATS:
        raise RequestError(
            f"'response_format.type' must be one of {list(_RESPONSE_FORMATS)}",
            param="response_format",
        )
    if kind == "text":
        return None
    limits.require(request_limits.RESPONSE_FORMAT)
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RequestError(
            "'response_format.json_schema.schema' must be a JSON schema object",
            param="response_format",
        )
    return {"json": schema}


def _logprobs(body: dict[str, Any], limits: RequestLimits, *, chat: bool) -> int | None:
    """How many alternatives per token to return with log probabilities (None: none).

    Chat: `logprobs: true` with `top_logprobs` (default 0); completions: `logprobs: N`."""
    value = body.get("logprobs")
    top = body.get("top_logprobs") if chat else None
    if chat:
        if value is not None and not isinstance(value, bool):
            raise RequestError("'logprobs' must be a boolean", param="logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or top < 0:
                raise RequestError(
                    "'top_logprobs' must be a non-negative integer", param="top_logprobs"
                )
            if not value:
                raise RequestError(
                    "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs"
                )
        if not value:
            return None
        count, param = top or 0, "top_logprobs"
    else:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RequestError("'logprobs' must be a non-negative integer", param="logprobs")
        count, param = value, "logprobs"
    limits.require(request_limits.LOGPROBS, "logprobs")
    if count > limits.max_logprobs:
        raise RequestError(
            f"'{param}' must be at most {limits.max_logprobs}, got {count}", param=param
        )
    return count


def stop_strings(body: dict[str, Any]) -> list[str]:
    """`stop` as a list (a string, a list of strings, or absent)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(item, str) and item for item in stop):
        return list(stop)
    raise RequestError(
        "'stop' must be a non-empty string or an array of non-empty strings", param="stop"
    )


def max_tokens_of(body: dict[str, Any], *, chat: bool) -> int | None:
    """`max_tokens` (or, for chat, `max_completion_tokens`), if given."""
    value = optional_int(body, "max_tokens", 1)
    if value is None and chat:
        value = optional_int(body, "max_completion_tokens", 1)
    return value


def stop_conditions(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """Engine stop conditions for the request."""
    conditions: dict[str, Any] = {}
    if max_tokens is not None:
        conditions["max_tokens"] = max_tokens
    stops = stop_strings(body)
    if stops:
        conditions["stop"] = stops
    if body.get("ignore_eos") is not None:
        conditions["ignore_eos"] = _optional_bool(body, "ignore_eos")
    min_tokens = optional_int(body, "min_tokens", 0)
    if min_tokens is not None:
        conditions["min_tokens"] = min_tokens
    return conditions


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The completion prompt: a string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt)
    ):
        return prompt
    raise RequestError(
        "'prompt' must be a string or an array of token ids (one prompt per request)",
        param="prompt",
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages, checked for the fields a chat template needs."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where} must be an object with a string 'role'", param=where)
        if message["role"] not in _ROLES:
            raise RequestError(
                f"{where}.role {message['role']!r} is not one of {sorted(_ROLES)}",
                param=f"{where}.role",
            )
        content = message.get("content")
        if isinstance(content, list):
            # Text parts only: this worker serves text models.
            texts = [
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            ]
            if len(texts) != len(content):
                raise RequestError(
                    f"{where}.content parts must be text parts", param=f"{where}.content"
                )
            messages[index] = {**message, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise RequestError(
                f"{where}.content must be a string or text parts", param=f"{where}.content"
            )
    return messages


def new_id(prefix: str) -> str:
    """A response id like upstream's (`cmpl-…`, `chatcmpl-…`)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created` timestamp (seconds)."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI usage block."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def openai_finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons as OpenAI reports them ("eos" is "stop"; "cancelled" stays)."""
    if reason == "eos":
        return "stop"
    if reason == "abort":
        return "cancelled"
    return reason


def _head(response_id: str, created: int, model: Any, kind: str) -> dict[str, Any]:
    """The fields every response and streamed event starts with."""
    return {"id": response_id, "object": kind, "created": created, "model": model}


def completion_chunk(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed `text_completion` event."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_head(response_id, created, model, "text_completion"), "choices": [choice]}


def chat_chunk(
    response_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed `chat.completion.chunk` event."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_head(response_id, created, model, "chat.completion.chunk"), "choices": [choice]}


def text_chunk(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    *,
    chat: bool,
) -> dict[str, Any]:
    """`chat_chunk` with a text delta (empty when `text` is) or `completion_chunk`."""
    if not chat:
        return completion_chunk(response_id, created, model, text, finish_reason, logprobs)
    delta = {"content": text} if text else {}
    return chat_chunk(response_id, created, model, delta, finish_reason, logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability and its best alternatives (best first)."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs` (`{"content": [...]}`)."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`,
    `text_offset`); offsets count from `text_offset`."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_best_first(e.top) for e in entries],
        "text_offset": offsets,
    }


def _best_first(top: list[tuple[str, float]]) -> dict[str, float]:
    """Alternatives by token text, best first; those that decode alike (partial UTF-8)
    share a key, which the best of them keeps."""
    alternatives: dict[str, float] = {}
    for token, logprob in top:
        alternatives.setdefault(token, logprob)
    return alternatives


_encoder = msgspec.json.Encoder()
_NO_FINISH = b',"logprobs":null,"finish_reason":null}]}'
_FINISH = b',"logprobs":null,"finish_reason":'
_EMPTY_DELTA = b"{}"
_CONTENT = b'{"content":'


class ChunkTemplate:
    """One streamed response's events, `completion_chunk` or `chat_chunk` with a text delta,
    encoded as JSON straight into a buffer: the same bytes as encoding those dicts, but the
    fields that never change within a response are encoded once, and no dict is built per
    event (this runs once per generated token)."""

    __slots__ = ("_chat", "_head")

    def __init__(self, response_id: str, created: int, model: Any, *, chat: bool) -> None:
        encode = _encoder.encode
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._chat = chat
        self._head = b"".join(
            (
                b'{"id":',
                encode(response_id),
                b',"object":',
                encode(kind),
                b',"created":',
                encode(created),
                b',"model":',
                encode(model),
                b',"choices":[{"index":0,"delta":' if chat else b',"choices":[{"index":0,"text":',
            )
        )

    def encode_into(self, buffer: bytearray, text: str, finish_reason: str | None) -> None:
        """Append the event for `text` (a chat delta carries it as `content`, or is empty
        when `text` is) and `finish_reason` to `buffer`."""
        buffer += self._head
        if not self._chat:
            _encoder.encode_into(text, buffer, -1)
        elif text:
            buffer += _CONTENT
            _encoder.encode_into(text, buffer, -1)
            buffer += b"}"
        else:
            buffer += _EMPTY_DELTA
        if finish_reason is None:
            buffer += _NO_FINISH
        else:
            buffer += _FINISH
            _encoder.encode_into(finish_reason, buffer, -1)
            buffer += b"}]}"


def usage_chunk(
    response_id: str, created: int, model: str, *, chat: bool, usage_block: dict[str, int]
) -> dict[str, Any]:
    """The final streamed event with `usage` (when `stream_options.include_usage`)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {**_head(response_id, created, model, kind), "choices": [], "usage": usage_block}


def text_response(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_block: dict[str, int],
    logprobs: dict[str, Any] | None = None,
    *,
    chat: bool,
) -> dict[str, Any]:
    """A whole (non-streamed) chat completion (`chat`) or completion."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    kind = "chat.completion" if chat else "text_completion"
    return {**_head(response_id, created, model, kind), "choices": [choice], "usage": usage_block}
