"""`RequestLimits`: what an engine accepts, published for the request planes to check against.

An engine that defines `request_limits() -> RequestLimits` (called once it has started)
publishes its context length, vocabulary size, the ranges of its sampling parameters, how
many alternatives per token it returns as log probabilities, and which optional OpenAI fields
it honours (`features`). Both request planes check every engine request against them before
the engine sees it (`check_request`), so a request that can never succeed is a 400 naming the
field, on the HTTP plane and on upstream's TCP plane alike. The engine's own checks stay as
the last line; they raise `RequestError` too.

Field names in messages and `param` are OpenAI's (`top_p`, `max_tokens`, `logprobs`), also
when the request came in as upstream's PreprocessedRequest (`sampling_options.top_p`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from dynamo.runtime.errors import CONTEXT_LENGTH_EXCEEDED, RequestError, not_supported

# The optional OpenAI (and vLLM-extension) fields an engine may honour.
SEED: Final = "seed"
TOP_K: Final = "top_k"
MIN_P: Final = "min_p"
PRESENCE_PENALTY: Final = "presence_penalty"
FREQUENCY_PENALTY: Final = "frequency_penalty"
REPETITION_PENALTY: Final = "repetition_penalty"
LOGIT_BIAS: Final = "logit_bias"
LOGPROBS: Final = "logprobs"
RESPONSE_FORMAT: Final = "response_format"
MIN_TOKENS: Final = "min_tokens"
IGNORE_EOS: Final = "ignore_eos"

ALL_FEATURES: Final = frozenset(
    {
        SEED,
        TOP_K,
        MIN_P,
        PRESENCE_PENALTY,
        FREQUENCY_PENALTY,
        REPETITION_PENALTY,
        LOGIT_BIAS,
        LOGPROBS,
        RESPONSE_FORMAT,
        MIN_TOKENS,
        IGNORE_EOS,
    }
)
# What an engine that publishes no limits is taken to honour (what the request plane passed
# on before engines published anything); log probabilities, logit bias and structured
# output are refused for it.
DEFAULT_FEATURES: Final = ALL_FEATURES - {LOGIT_BIAS, LOGPROBS, RESPONSE_FORMAT}

LOGIT_BIAS_LIMIT: Final = 100.0
DEFAULT_MAX_LOGPROBS: Final = 20


@dataclass(frozen=True)
class Range:
    """An interval a number must lie in (None: unbounded on that side)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        """`[0, 2]`, `(0, 1]`, `>= -1`, ..."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{_num(self.low)}, {_num(self.high)}{right}"

    def contains(self, value: float) -> bool:
        """Whether `value` lies in the interval (and is finite)."""
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (
            self.high is not None and (value >= self.high if self.high_open else value > self.high)
        )


def _num(value: float | None) -> str:
    if value is not None and float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


# vLLM's ranges (its SamplingParams checks), which the reference engine shares.
SAMPLING_RANGES: Final[Mapping[str, Range]] = {
    "temperature": Range(0, 2),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(-1, None, integer=True),
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, None, low_open=True),
    # What the engines' integer transports carry (msgpack, torch generators).
    "seed": Range(-(2**63), 2**64 - 1, integer=True),
}
# A sampling option at this value leaves sampling as it is: an engine without the feature
# may be sent it.
_NEUTRAL: Final[Mapping[str, Any]] = {
    "top_k": (0, -1),
    "min_p": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
}


@dataclass(frozen=True)
class RequestLimits:
    """What one engine accepts (see the module docstring). None: not checked here."""

    context_length: int | None = None
    vocab_size: int | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    features: frozenset[str] = DEFAULT_FEATURES
    sampling: Mapping[str, Range] = field(default_factory=lambda: dict(SAMPLING_RANGES))
    # How messages name the engine ("the transformers engine").
    engine: str = "this engine"

    def supports(self, feature: str) -> bool:
        """Whether the engine honours the optional field `feature`."""
        return feature in self.features

    def require(self, feature: str, param: str | None = None) -> None:
        """A 400 naming `param` (default: the feature) unless the engine honours `feature`."""
        if feature not in self.features:
            raise not_supported(param or feature, self.engine)

    def check_request(self, request: Mapping[str, Any], *, prompt_param: str = "prompt") -> None:
        """Raise a 400 `RequestError` naming the field when the engine request (a
        GenerateRequest / PreprocessedRequest) can never succeed. `prompt_param` is what the
        client called the prompt (`prompt`, `messages`, `token_ids`)."""
        token_ids = request.get("token_ids")
        if not isinstance(token_ids, list) or not token_ids:
            raise RequestError(f"'{prompt_param}' must not be empty", param=prompt_param)
        self._check_tokens(token_ids, prompt_param)
        sampling = _mapping(request, "sampling_options")
        stop = _mapping(request, "stop_conditions")
        output = _mapping(request, "output_options")
        self._check_sampling(sampling)
        max_tokens = self._check_stop(stop)
        self._check_context(len(token_ids), max_tokens, prompt_param)
        self._check_output(output)

    def _check_tokens(self, token_ids: list[Any], prompt_param: str) -> None:
        vocab = self.vocab_size
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise RequestError(
                    f"'{prompt_param}' token ids must be integers, got {token!r}",
                    param=prompt_param,
                )
            if token < 0 or (vocab is not None and token >= vocab):
                bound = f"[0, {vocab})" if vocab is not None else ">= 0"
                raise RequestError(
                    f"token id {token} in '{prompt_param}' is outside the model's vocabulary "
                    f"(ids must be in {bound})",
                    param=prompt_param,
                )

    def _check_sampling(self, options: Mapping[str, Any]) -> None:
        for key, bounds in self.sampling.items():
            value = options.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RequestError(f"'{key}' must be a number, got {value!r}", param=key)
            if bounds.integer and not isinstance(value, int):
                raise RequestError(f"'{key}' must be an integer, got {value!r}", param=key)
            if not bounds.contains(value):
                raise RequestError(
                    f"'{key}' must be in {bounds.describe()}, got {value!r}"
                    if bounds.low is not None and bounds.high is not None
                    else f"'{key}' must be {bounds.describe()}, got {value!r}",
                    param=key,
                )
            if key in _NEUTRAL and value in _NEUTRAL[key]:
                continue
            if key in ALL_FEATURES:
                self.require(key)
        for key in ("n", "best_of"):
            count = options.get(key)
            if count is not None and count != 1:
                raise RequestError(f"'{key}' must be 1: one choice per request", param="n")
        if options.get("use_beam_search"):
            raise not_supported("use_beam_search", self.engine)
        self._check_logit_bias(options.get("logit_bias"))
        if options.get("guided_decoding") is not None:
            self.require(RESPONSE_FORMAT)

    def _check_logit_bias(self, bias: Any) -> None:
        if bias is None or bias == {}:
            return
        if not isinstance(bias, Mapping):
            raise RequestError("'logit_bias' must map token ids to numbers", param="logit_bias")
        self.require(LOGIT_BIAS)
        for key, value in bias.items():
            token = _token_key(key)
            vocab = self.vocab_size
            if token is None or token < 0 or (vocab is not None and token >= vocab):
                raise RequestError(
                    f"'logit_bias' key {key!r} is not a token id of the model's vocabulary",
                    param="logit_bias",
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RequestError(
                    f"'logit_bias' values must be numbers, got {value!r}", param="logit_bias"
                )
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise RequestError(
                    f"'logit_bias' values must be in [-100, 100], got {value!r}",
                    param="logit_bias",
                )

    def _check_stop(self, conditions: Mapping[str, Any]) -> int | None:
        max_tokens = optional_int(conditions, "max_tokens", 1)
        min_tokens = optional_int(conditions, "min_tokens", 0)
        if min_tokens:
            self.require(MIN_TOKENS)
            if max_tokens is not None and min_tokens > max_tokens:
                raise RequestError(
                    f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})",
                    param="min_tokens",
                )
        if conditions.get("ignore_eos"):
            self.require(IGNORE_EOS)
        return max_tokens

    def _check_context(self, prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        limit = self.context_length
        if limit is None:
            return
        if prompt_tokens >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {prompt_tokens} tokens, and at least one token must be generated: "
                f"shorten the prompt to at most {limit - 1} tokens.",
                param=prompt_param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion): lower max_tokens to at most "
                f"{limit - prompt_tokens} or shorten the prompt.",
                param="max_tokens",
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def _check_output(self, options: Mapping[str, Any]) -> None:
        value = options.get("logprobs")
        if value is None or value is False:
            return
        self.require(LOGPROBS)
        if value is True:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RequestError(
                f"'logprobs' must be a non-negative integer, got {value!r}", param="logprobs"
            )
        if value > self.max_logprobs:
            raise RequestError(
                f"at most {self.max_logprobs} log probabilities per token may be requested, "
                f"got {value}",
                param="logprobs",
            )


def limits_of(engine: Any, context_length: int | None) -> RequestLimits:
    """The engine's published limits (`request_limits()`), or defaults with the context
    length it registered."""
    publish = getattr(engine, "request_limits", None)
    if callable(publish):
        limits = publish()
        if isinstance(limits, RequestLimits):
            return limits
    return RequestLimits(context_length=context_length)


def _mapping(request: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = request.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError(f"'{key}' must be an object", param=key)
    return value


def optional_int(fields: Mapping[str, Any], key: str, minimum: int) -> int | None:
    """`fields[key]` when given: an integer `>= minimum`, else a 400 naming `key`."""
    value = fields.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"'{key}' must be an integer >= {minimum}, got {value!r}", param=key)
    return value


def _token_key(key: Any) -> int | None:
    """A logit_bias key as a token id (JSON keys are strings of digits)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return None
