"""A corpus of bad OpenAI requests for differential tests against vLLM's own server, and a
client that records how a server answers each one.

Each `BadRequest` is a body (or raw bytes) for one route. `differs` says why our worker
answers it otherwise than vLLM's server, on purpose; the parity test then checks only that
ours is a 4xx naming the field, and that vLLM's answer still differs (a stale note fails).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SERVED = "tiny-llama"
HI = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class BadRequest:
    """One request that can never succeed (on our worker), and why vLLM may disagree."""

    name: str
    path: str
    body: Any
    # Why we answer differently from vLLM's server on purpose (None: we answer alike).
    differs: str | None = None
    # The `param` our answer names (None: not checked beyond matching vLLM's).
    param: str | None = None


def chat(
    name: str, differs: str | None = None, param: str | None = None, **fields: Any
) -> BadRequest:
    body = {"model": SERVED, "messages": HI, "max_tokens": 4, **fields}
    return BadRequest(name, CHAT, body, differs, param)


def completion(
    name: str, differs: str | None = None, param: str | None = None, **fields: Any
) -> BadRequest:
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 4, **fields}
    return BadRequest(name, COMPLETIONS, body, differs, param)


def without(request: BadRequest, key: str) -> BadRequest:
    body = {k: v for k, v in request.body.items() if k != key}
    return BadRequest(request.name, request.path, body, request.differs, request.param)


UNKNOWN_FIELDS = (
    "vLLM ignores fields it does not know (it logs a warning); we refuse them, so a typo or an "
    "unsupported option is never silently dropped"
)
N_CHOICES = "vLLM returns n choices; this worker's engine contract streams one choice per request"
ROLES = "vLLM hands any role to the chat template; we accept OpenAI's roles only"
BIAS_RANGE = "vLLM clamps logit_bias values into [-100, 100]; we refuse them, as OpenAI does"
STRICT_TYPES = (
    "vLLM's request models coerce a string to the number or boolean it spells ('4', 'yes'); "
    "we take JSON's types as sent, so a mistyped value is refused, not guessed at"
)

CORPUS: list[BadRequest] = [
    # The context.
    completion("prompt past the context", prompt="hello " * 1000, param="prompt"),
    completion("token prompt past the context", prompt=[1] * 600, param="prompt"),
    chat("messages past the context", messages=[{"role": "user", "content": "hi " * 1000}]),
    completion("max_tokens past the context", max_tokens=600, param="max_tokens"),
    chat("chat max_tokens past the context", max_tokens=600, param="max_tokens"),
    # max_tokens itself.
    completion("max_tokens 0", max_tokens=0, param="max_tokens"),
    completion("max_tokens negative", max_tokens=-1, param="max_tokens"),
    completion("max_tokens a string", STRICT_TYPES, "max_tokens", max_tokens="4"),
    without(chat("max_completion_tokens 0", max_completion_tokens=0), "max_tokens"),
    completion("min_tokens over max_tokens", min_tokens=10, param="min_tokens"),
    # Sampling ranges.
    completion("temperature negative", temperature=-1, param="temperature"),
    completion("temperature over 2", temperature=2.5, param="temperature"),
    chat("temperature a string", temperature="hot", param="temperature"),
    completion("top_p 0", top_p=0, param="top_p"),
    chat("top_p 2", top_p=2, param="top_p"),
    completion("top_p negative", top_p=-0.5, param="top_p"),
    completion("top_k -2", top_k=-2, param="top_k"),
    completion("min_p over 1", min_p=1.5, param="min_p"),
    completion("presence_penalty 3", presence_penalty=3, param="presence_penalty"),
    completion("frequency_penalty -2.5", frequency_penalty=-2.5, param="frequency_penalty"),
    completion("repetition_penalty 0", repetition_penalty=0, param="repetition_penalty"),
    completion("repetition_penalty negative", repetition_penalty=-1, param="repetition_penalty"),
    completion("seed a string", seed="x", param="seed"),
    completion("n 0", n=0, param="n"),
    completion("n 2", N_CHOICES, param="n", n=2),
    # Token ids and prompts.
    completion("token id past the vocabulary", prompt=[99999999], param="prompt"),
    completion("negative token id", prompt=[-1], param="prompt"),
    completion("empty token prompt", prompt=[], param="prompt"),
    completion("prompt a number", prompt=5, param="prompt"),
    without(completion("no prompt"), "prompt"),
    # Messages.
    without(chat("no messages"), "messages"),
    chat("messages empty", messages=[], param="messages"),
    chat("a message without a role", messages=[{"content": "hi"}], param="messages[0]"),
    chat("role wizard", ROLES, "messages[0].role", messages=[{"role": "wizard", "content": "x"}]),
    chat("content a number", messages=[{"role": "user", "content": 5}]),
    # Log probabilities.
    completion("logprobs negative", logprobs=-1, param="logprobs"),
    completion("logprobs past max_logprobs", logprobs=21, param="logprobs"),
    chat("top_logprobs past max_logprobs", logprobs=True, top_logprobs=21, param="top_logprobs"),
    chat("top_logprobs without logprobs", top_logprobs=2, param="top_logprobs"),
    chat("logprobs a string", STRICT_TYPES, "logprobs", logprobs="yes"),
    # Stops, bias, streams, formats.
    completion("stop a number", stop=5, param="stop"),
    completion("logit_bias token past the vocabulary", logit_bias={"999999": 1}),
    completion("logit_bias over 100", BIAS_RANGE, "logit_bias", logit_bias={"1": 500}),
    completion("logit_bias a list", logit_bias=[1, 2], param="logit_bias"),
    completion("stream_options without stream", stream_options={"include_usage": True}),
    chat("response_format yaml", response_format={"type": "yaml"}, param="response_format"),
    chat(
        "json_schema without a schema",
        response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        param="response_format",
    ),
    chat("tools not a list", tools="f", param="tools"),
    # Models and bodies.
    chat("unknown model", model="no-such-model", param="model"),
    completion("model a number", model=5, param="model"),
    completion("unknown field", UNKNOWN_FIELDS, "wizardry", wizardry=True),
    chat("ignore_eos a string", ignore_eos="x", param="ignore_eos"),
    BadRequest("body not JSON", COMPLETIONS, b"{"),
    BadRequest("body an array", CHAT, b"[]"),
]


@dataclass(frozen=True)
class Answer:
    """A server's answer to one corpus request: status and the error's `param`."""

    status: int
    param: str | None
    message: str

    @property
    def status_class(self) -> str:
        return f"{self.status // 100}xx"


async def answer(session: aiohttp.ClientSession, base_url: str, request: BadRequest) -> Answer:
    """POST the request (not streamed) and read status and `error.param`."""
    data = request.body if isinstance(request.body, bytes) else json.dumps(request.body)
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=120)
    async with session.post(
        base_url + request.path, data=data, headers=headers, timeout=timeout
    ) as response:
        text = await response.text()
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        param = error.get("param")
        return Answer(response.status, param if isinstance(param, str) else None, str(error))
    return Answer(response.status, None, text[:300])
