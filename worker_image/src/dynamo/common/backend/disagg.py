"""Helpers for engines serving in disaggregated (prefill/decode) mode."""

from __future__ import annotations

from typing import Any

from dynamo.common.backend.engine import GenerateRequest
from dynamo.common.constants import DisaggregationMode


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
