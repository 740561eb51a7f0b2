"""A request's sampling options and stop conditions as vLLM `SamplingParams` arguments.

The request plane's fields are checked by the same parsers the reference engine uses (one
reading of `sampling_options` and `stop_conditions` for every engine); this module only
renames them into vLLM's keyword arguments. Plain data in, plain data out: it imports no
vLLM, so it is tested in the project venv.
"""

from __future__ import annotations

from typing import Any

from dynamo.common.backend import GenerateRequest
from dynamo.engines.transformers_engine import SamplingParams, StopParams
from dynamo.runtime.errors import RequestError


def sampling_kwargs(request: GenerateRequest, default_max_tokens: int) -> dict[str, Any]:
    """`SamplingParams(**kwargs)` for one request (a `RequestError` naming the bad field).

    `default_max_tokens` applies when the request sets no `max_tokens` (the context left
    after the prompt). Output is token ids only (`detokenize=False`): the frontend
    detokenizes, and stop strings are its business too. `structured_outputs` is the
    keyword arguments of vLLM's `StructuredOutputsParams` (None: free text); the engine
    builds it, since this module imports no vLLM.
    """
    sampling = SamplingParams.from_options(request.get("sampling_options") or {})
    stop = StopParams.from_conditions(request.get("stop_conditions") or {}, default_max_tokens)
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logit_bias": dict(sampling.logit_bias) or None,
        "structured_outputs": structured_outputs(sampling.guided_decoding),
        "max_tokens": stop.max_tokens,
        "min_tokens": stop.min_tokens,
        "stop_token_ids": sorted(stop.stop_token_ids),
        "ignore_eos": stop.ignore_eos,
        "logprobs": requested_logprobs(request.get("output_options") or {}),
        "detokenize": False,
    }


# upstream's guided_decoding keys (and ours: `json_object`) -> StructuredOutputsParams'.
_GUIDED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "whitespace_pattern")


def structured_outputs(guided: dict[str, Any] | None) -> dict[str, Any] | None:
    """`sampling_options.guided_decoding` as `StructuredOutputsParams` keyword arguments."""
    if not guided:
        return None
    kwargs = {key: guided[key] for key in _GUIDED_KEYS if guided.get(key) is not None}
    if not kwargs.keys() - {"whitespace_pattern"}:
        raise RequestError(
            "'response_format' asks for structured output without a constraint",
            param="response_format",
        )
    return kwargs


def requested_logprobs(output_options: dict[str, Any]) -> int | None:
    """How many top alternatives to return per token: None for no log probabilities, 0 for
    the sampled token's alone (`logprobs: true` or 0), N for N alternatives besides it."""
    value = output_options.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(
            f"'logprobs' must be a non-negative integer or true, got {value!r}", param="logprobs"
        )
    return value
