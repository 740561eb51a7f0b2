"""OpenAI request parsing and response shapes for `/v1/completions` and `/v1/chat/completions`.

Pure functions: the request plane turns an OpenAI body into engine options with these and
formats engine output back. Parameters the engines understand map to `sampling_options`
(temperature, top_p, top_k, seed, penalties) and `stop_conditions` (max_tokens, stop,
ignore_eos, min_tokens); `n` other than 1 and `best_of`/`logprobs`-style options this runtime
does not implement are refused with a 400 naming the parameter.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from dynamo.runtime.errors import RequestError


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        503: "service_unavailable",
    }.get(status, "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


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
_UNSUPPORTED = ("best_of", "logit_bias", "tools", "functions", "suffix", "echo")


def _number(body: dict[str, Any], key: str) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"'{key}' must be a number", param=key)
    return value


def _optional_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"'{key}' must be an integer >= {minimum}", param=key)
    return value


def sampling_options(body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling parameters that were given."""
    for key in _UNSUPPORTED:
        if body.get(key):
            raise RequestError(f"'{key}' is not supported by this worker", param=key)
    n = _optional_int(body, "n", 1)
    if n not in (None, 1):
        raise RequestError("'n' must be 1: this worker returns one choice", param="n")
    options: dict[str, Any] = {}
    for key in _SAMPLING_KEYS:
        value = _number(body, key)
        if value is not None:
            options[key] = value
    return options


def stop_strings(body: dict[str, Any]) -> list[str]:
    """`stop` as a list (a string, a list of strings, or absent)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        return list(stop)
    raise RequestError("'stop' must be a string or an array of strings", param="stop")


def max_tokens_of(body: dict[str, Any], *, chat: bool) -> int | None:
    """`max_tokens` (or, for chat, `max_completion_tokens`), if given."""
    value = _optional_int(body, "max_tokens", 1)
    if value is None and chat:
        value = _optional_int(body, "max_completion_tokens", 1)
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
        conditions["ignore_eos"] = bool(body["ignore_eos"])
    min_tokens = _optional_int(body, "min_tokens", 0)
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
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(
                f"messages[{index}] must be an object with a string 'role'", param="messages"
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
                    f"messages[{index}].content parts must be text parts", param="messages"
                )
            messages[index] = {**message, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise RequestError(
                f"messages[{index}].content must be a string or text parts", param="messages"
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


def completion_chunk(
    response_id: str, created: int, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    """One streamed `text_completion` event."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(
    response_id: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    """One streamed `chat.completion.chunk` event."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


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
    return {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_block,
    }


def completion_response(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_block: dict[str, int],
) -> dict[str, Any]:
    """A whole (non-streamed) completion."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_block,
    }


def chat_response(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_block: dict[str, int],
) -> dict[str, Any]:
    """A whole (non-streamed) chat completion."""
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_block,
    }
