"""Helpers for engines serving in disaggregated (prefill/decode) mode."""

from __future__ import annotations

from typing import Any

from dynamo.common.backend.engine import GenerateChunk, GenerateRequest
from dynamo.common.constants import DisaggregationMode

# The roles a worker here can take (upstream's encode role needs a multimodal encoder).
DISAGGREGATION_MODES = tuple(
    mode.value for mode in DisaggregationMode if mode is not DisaggregationMode.ENCODE
)


def enforce_prefill_max_tokens(request: GenerateRequest) -> GenerateRequest:
    """Set `stop_conditions.max_tokens` to 1 in place (call on prefill workers only).

    A prefill worker only fills the KV cache for the prompt; more tokens waste compute and
    break the prefill-to-decode handoff.
    """
    stop_conditions = request.setdefault("stop_conditions", {})
    stop_conditions["max_tokens"] = 1
    return request


def extract_prefill_result(request: GenerateRequest) -> dict[str, Any] | None:
    """Return the request's `prefill_result` (set on decode-bound requests), or None."""
    return request.get("prefill_result")


def require_prefill_result(request: GenerateRequest, mode: DisaggregationMode) -> dict[str, Any]:
    """Return `prefill_result`, raising ValueError naming the worker role when it is missing."""
    prefill_result = extract_prefill_result(request)
    if prefill_result is None:
        raise ValueError(
            f"{mode.value} worker received request with no prefill_result; expected the "
            "frontend's prefill router to forward disaggregated_params from a prefill peer"
        )
    return prefill_result


def prefill_only(request: GenerateRequest) -> GenerateRequest:
    """A copy of `request` that stops after one token, as upstream's prefill workers run it:
    `max_tokens` and `min_tokens` 1 (a client's larger `min_tokens` would otherwise be refused
    against `max_tokens` 1)."""
    stop_conditions = {**(request.get("stop_conditions") or {}), "max_tokens": 1, "min_tokens": 1}
    return {**request, "stop_conditions": stop_conditions}


def received_kv_transfer_params(prefill_result: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's KV-transfer parameters a prefill worker handed over, or None (a prefill
    that had nothing to hand over writes `disaggregated_params: null`)."""
    disaggregated = prefill_result.get("disaggregated_params") or {}
    params = disaggregated.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def with_prefill_usage(
    chunk: GenerateChunk, prefill_result: dict[str, Any] | None
) -> GenerateChunk:
    """`chunk` with the prefill worker's `prompt_tokens_details` in its usage, as upstream's
    decode workers report it: the prompt was processed (and its cache hits counted) there."""
    usage = chunk.get("completion_usage")
    if prefill_result is None or usage is None:
        return chunk
    details = prefill_result.get("prompt_tokens_details")
    return {**chunk, "completion_usage": {**usage, "prompt_tokens_details": details}}
