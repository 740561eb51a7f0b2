"""Hypothesis strategies for OpenAI completions and chat bodies, valid and invalid, and a
blocking client that reads one answer of the worker's OpenAI routes.

`valid_bodies(chat, vocab_size)` draws requests the transformers engine must answer 200
(every field it honours, in range, at most 8 tokens out); `invalid_bodies(chat, ...)` draws a
valid body with one mutation that makes it a request that can never succeed (a 4xx):
out-of-range and mistyped values, unknown fields and roles, token ids outside the
vocabulary, prompts past the context, fields the engine does not honour, or a body that is
not an object at all. `DYNAMO_FUZZ_EXAMPLES` sets how many examples a property runs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import strategies as st

FUZZ_EXAMPLES_ENV = "DYNAMO_FUZZ_EXAMPLES"
DEFAULT_FUZZ_EXAMPLES = 300
# No answer may take longer than this (a hang is a failure, not a slow pass).
ANSWER_BOUND_SECS = 30.0
MAX_OUTPUT_TOKENS = 8


def fuzz_examples() -> int:
    """How many examples each property runs (`DYNAMO_FUZZ_EXAMPLES`, default 300)."""
    return int(os.environ.get(FUZZ_EXAMPLES_ENV) or DEFAULT_FUZZ_EXAMPLES)


_small_text = st.text(min_size=1, max_size=24)


def _floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


def _optional_fields(chat: bool, vocab_size: int) -> st.SearchStrategy[dict[str, Any]]:
    """The optional fields, each in range, each present or not."""
    fields: dict[str, st.SearchStrategy[Any]] = {
        "temperature": _floats(0, 2),
        "top_p": _floats(0.01, 1),
        "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
        "min_p": _floats(0, 1),
        "seed": st.integers(-(2**63), 2**64 - 1),
        "presence_penalty": _floats(-2, 2),
        "frequency_penalty": _floats(-2, 2),
        "repetition_penalty": _floats(0.5, 2),
        "logit_bias": st.dictionaries(
            st.integers(0, vocab_size - 1).map(str), _floats(-100, 100), max_size=3
        ),
        "stop": st.one_of(_small_text, st.lists(_small_text, min_size=1, max_size=3)),
        "ignore_eos": st.booleans(),
        "n": st.just(1),
        "user": _small_text,
        "response_format": st.just({"type": "text"}),
        "model": st.just(None),
    }
    if chat:
        fields["metadata"] = st.dictionaries(_small_text, _small_text, max_size=2)
        fields["tool_choice"] = st.sampled_from(["none", "auto"])
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def valid_bodies(draw: st.DrawFn, chat: bool, vocab_size: int) -> dict[str, Any]:
    """A request the worker must answer 200."""
    body = dict(draw(_optional_fields(chat, vocab_size)))
    body = {key: value for key, value in body.items() if value is not None}
    max_tokens = draw(st.integers(1, MAX_OUTPUT_TOKENS))
    body["max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"] = max_tokens
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, max_tokens))
    if chat:
        roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
        body["messages"] = draw(
            st.lists(
                st.fixed_dictionaries({"role": roles, "content": st.text(max_size=40)}),
                min_size=1,
                max_size=3,
            )
        )
        if draw(st.booleans()):
            body["logprobs"] = True
            if draw(st.booleans()):
                body["top_logprobs"] = draw(st.integers(0, 5))
    else:
        body["prompt"] = draw(
            st.one_of(
                st.text(min_size=0, max_size=60),
                st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=40),
            )
        )
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


# Mutations that make any valid body one that can never succeed: (field, bad value).
_BAD_VALUES: list[tuple[str, Any]] = [
    ("temperature", -0.5),
    ("temperature", 2.5),
    ("temperature", "hot"),
    ("top_p", 0),
    ("top_p", 2),
    ("top_p", True),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("seed", 2**64),
    ("seed", "7"),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 100_000),
    ("max_tokens", "8"),
    ("n", 2),
    ("n", 0),
    ("stop", [""]),
    ("stop", 5),
    ("logit_bias", {"999999": 1}),
    ("logit_bias", {"1": 500}),
    ("logit_bias", [1, 2]),
    ("user", 5),
    ("stream", "yes"),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "yaml"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("unknown_field", 1),
    ("model", "no-such-model"),
    ("model", 5),
]


@st.composite
def invalid_bodies(
    draw: st.DrawFn, chat: bool, vocab_size: int, context_length: int
) -> tuple[Any, str]:
    """A body that can never succeed, and the mutation that made it so (for messages)."""
    kind = draw(st.sampled_from(["value", "prompt", "shape", "logprobs"]))
    body: Any = draw(valid_bodies(chat, vocab_size))
    if kind == "value":
        key, value = draw(st.sampled_from(_BAD_VALUES))
        if key == "max_tokens":
            body.pop("max_completion_tokens", None)
            body.pop("min_tokens", None)
        body[key] = value
        return body, f"{key}={value!r}"
    if kind == "logprobs":
        if chat:
            body.pop("logprobs", None)
            body["top_logprobs"] = draw(st.integers(0, 5))
        else:
            body["logprobs"] = draw(st.sampled_from([-1, 21, True, "2"]))
        return body, "logprobs"
    if kind == "prompt":
        if chat:
            mutation = draw(st.sampled_from(["role", "empty", "content", "long"]))
            if mutation == "role":
                body["messages"][0]["role"] = "wizard"
            elif mutation == "empty":
                body["messages"] = []
            elif mutation == "content":
                body["messages"][0]["content"] = {"text": "x"}
            else:
                body["messages"] = [{"role": "user", "content": "hello " * context_length}]
            return body, f"messages ({mutation})"
        mutation = draw(st.sampled_from(["vocab", "negative", "empty", "long", "type"]))
        body["prompt"] = {
            "vocab": [1, vocab_size + draw(st.integers(0, 10**9))],
            "negative": [1, -1],
            "empty": [],
            "long": [1] * (context_length + draw(st.integers(0, 100))),
            "type": 5,
        }[mutation]
        return body, f"prompt ({mutation})"
    not_an_object = st.one_of(
        st.lists(st.integers(), max_size=3), st.text(max_size=5), st.integers(), st.none()
    )
    return draw(not_an_object), "not an object"


@dataclass
class Answer:
    """One answer: status, the JSON body (or the stream's events) and how long it took."""

    status: int
    body: Any
    events: list[Any]
    done: bool
    seconds: float


def post(client: httpx.Client, url: str, body: Any) -> Answer:
    """POST `body` as JSON and read the whole answer (an SSE stream into its events; `done`
    when it ended with `[DONE]`)."""
    started = time.monotonic()
    with client.stream("POST", url, content=json.dumps(body)) as response:
        events: list[Any] = []
        done = False
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[len("data: ") :]))
            parsed: Any = None
        else:
            raw = response.read()
            parsed = json.loads(raw) if raw else None
    return Answer(response.status_code, parsed, events, done, time.monotonic() - started)
