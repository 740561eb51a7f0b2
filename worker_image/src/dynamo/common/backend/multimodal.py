"""Helpers for engines handling multimodal requests and encode/prefill handoffs."""

from __future__ import annotations

from typing import Any

from dynamo.common.backend.engine import GenerateChunk, GenerateRequest
from dynamo.common.constants import DisaggregationMode

_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs")


def extract_multimodal_kwargs(request: GenerateRequest) -> dict[str, Any] | None:
    """Return the non-None `multi_modal_data` / `mm_processor_kwargs` as kwargs, or None.

    `extract_multimodal_kwargs(req) or {}` splats directly into engine APIs that take
    those keyword names.
    """
    kwargs = {key: request.get(key) for key in _MULTIMODAL_KEYS if request.get(key) is not None}
    return kwargs or None


def require_encoder_result(request: GenerateRequest, mode: DisaggregationMode) -> dict[str, Any]:
    """Return the request's `encoder_result` object, raising ValueError if missing or not a dict."""
    encoder_result = request.get("encoder_result")
    if encoder_result is None:
        raise ValueError(
            f"{mode.value} worker received request with no encoder_result; expected the "
            "frontend to forward the encoder handoff payload from an Encode peer"
        )
    if not isinstance(encoder_result, dict):
        raise ValueError(
            f"{mode.value} worker received encoder_result of type "
            f"{type(encoder_result).__name__}; it must be a JSON object"
        )
    return encoder_result


def encoder_terminal_chunk(
    encoder_result: dict[str, Any], *, completion_usage: dict[str, Any] | None = None
) -> GenerateChunk:
    """Build the single terminal chunk an Encode worker yields (finish reason "stop")."""
    chunk = GenerateChunk(
        token_ids=[], index=0, finish_reason="stop", encoder_result=encoder_result
    )
    if completion_usage is not None:
        chunk["completion_usage"] = completion_usage
    return chunk
