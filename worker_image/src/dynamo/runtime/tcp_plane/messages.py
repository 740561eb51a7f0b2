"""What travels inside the frames: the request's control message and the response items.

Request payload: a two-part message whose header is the JSON control message
(`id`, `request_type` "single_in", `response_type` "many_out", `payload_codec` "msgpack" or
"json" (absent = json), `connection_info` `{"transport": "tcp_server", "info": "<JSON text of
{address, subject, context, stream_type}>"}`, optional `metadata`) and whose body is the
request (upstream's PreprocessedRequest, or the OpenAI request for text-input workers) in
`payload_codec`.

Response stream, on the worker's call-home connection to `info.address`, all two-part:
handshake (header `{"subject", "stream_type": "response"}`), prologue (header
`{"error": null}`), one data-only item per output (`{"data": <Annotated>, "complete_final":
false}` in `payload_codec`; the Annotated is `{"data": <LLMEngineOutput>}` or an error), then
`{"complete_final": true}` and the header-only JSON string `"sentinel"`. The frontend may
send the header-only `"stop"` or `"kill"` at any time: the worker then stops and sends
nothing more.

Error items (upstream's DynamoError inside the Annotated) decide the frontend's HTTP status:
`{"Backend": "InvalidArgument"}` -> 400, `"Unknown"` -> 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dynamo.runtime.tcp_plane.codec import CODECS

SENTINEL = b'"sentinel"'
PROLOGUE_OK = b'{"error":null}'
STOP, KILL = "stop", "kill"

# Upstream's error_type values the frontend maps to HTTP statuses.
INVALID_ARGUMENT: Any = {"Backend": "InvalidArgument"}
UNKNOWN: Any = "Unknown"

# LLMEngineOutput's fields (upstream's names); anything else an engine yields is dropped.
OUTPUT_FIELDS = frozenset(
    {
        "token_ids",
        "tokens",
        "text",
        "output_type",
        "content_parts",
        "cum_log_probs",
        "log_probs",
        "top_logprobs",
        "finish_reason",
        "stop_reason",
        "index",
        "completion_usage",
        "disaggregated_params",
        "encoder_result",
        "worker_trace_link",
        "extra_args",
        "engine_data",
        "routing_data",
    }
)
_PLAIN_FIELDS = frozenset({"token_ids", "index"})
_FINISH_REASONS = frozenset({"eos", "length", "stop", "cancelled", "content_filter"})
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


class ControlError(ValueError):
    """A control message this worker cannot act on (it cannot even call home)."""


@dataclass(frozen=True)
class RequestControl:
    """The parts of the control message the worker uses."""

    request_id: str
    codec: str
    address: str
    subject: str
    metadata: dict[str, Any] = field(default_factory=dict)


def parse_control(header: bytes) -> RequestControl:
    """Read a request's control message; ControlError naming what is wrong."""
    try:
        control = json.loads(header)
    except ValueError as exc:
        raise ControlError(f"control message is not JSON: {exc}") from None
    if not isinstance(control, dict):
        raise ControlError("control message is not a JSON object")
    request_type = control.get("request_type", "single_in")
    if request_type != "single_in":
        raise ControlError(
            f"request_type {request_type!r} is not supported (only single_in requests)"
        )
    codec = control.get("payload_codec") or "json"
    if codec not in CODECS:
        raise ControlError(f"payload_codec {codec!r} is not one of {CODECS}")
    connection = control.get("connection_info")
    if not isinstance(connection, dict) or connection.get("transport") != "tcp_server":
        transport = connection.get("transport") if isinstance(connection, dict) else None
        raise ControlError(
            f"connection_info.transport {transport!r} is not supported; run the frontend with "
            "the tcp response plane (the default)"
        )
    info = connection.get("info")
    try:
        info = json.loads(info) if isinstance(info, str) else info
    except ValueError as exc:
        raise ControlError(f"connection_info.info is not JSON: {exc}") from None
    if not isinstance(info, dict):
        raise ControlError("connection_info.info is not a JSON object")
    address, subject = info.get("address"), info.get("subject")
    if not isinstance(address, str) or not isinstance(subject, str):
        raise ControlError("connection_info.info lacks the string fields address and subject")
    request_id = control.get("id") or info.get("context") or subject
    metadata = control.get("metadata")
    return RequestControl(
        request_id=str(request_id),
        codec=codec,
        address=address,
        subject=subject,
        metadata=dict(metadata) if isinstance(metadata, dict) else {},
    )


def split_address(address: str) -> tuple[str, int]:
    """`("host", port)` of `ip:port` or `[ipv6]:port`; ControlError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ControlError(f"call-home address {address!r} is not ip:port")
    return host.strip("[]"), int(port)


def handshake(subject: str) -> bytes:
    """The first header on the call-home connection."""
    return json.dumps({"subject": subject, "stream_type": "response"}).encode("utf-8")


def prologue_error(message: str) -> bytes:
    """A prologue that fails the request before any output (the frontend answers 503)."""
    return json.dumps({"error": message}).encode("utf-8")


def output_item(chunk: dict[str, Any]) -> dict[str, Any]:
    """The stream item for one engine chunk (a GenerateChunk becomes an LLMEngineOutput)."""
    if chunk.keys() <= _PLAIN_FIELDS:  # the common case: a plain token delta
        output = chunk
    else:
        output = {name: value for name, value in chunk.items() if name in OUTPUT_FIELDS}
        if "finish_reason" in output:
            output["finish_reason"] = finish_reason(output["finish_reason"])
        usage = output.get("completion_usage")
        if usage is not None and not _full_usage(usage):
            # The frontend refuses a partial usage block (HTTP 500); it counts tokens itself.
            del output["completion_usage"]
    return {"data": {"data": output}, "complete_final": False}


def raw_item(response: Any) -> dict[str, Any]:
    """The stream item for one response object of a text-input (raw) engine."""
    return {"data": {"data": response}, "complete_final": False}


def error_item(message: str, error_type: Any = UNKNOWN) -> dict[str, Any]:
    """An in-band error item: the frontend fails the request with the type's HTTP status."""
    error = {"error_type": error_type, "message": message}
    return {"data": {"event": "error", "error": error}, "complete_final": False}


COMPLETE_FINAL: dict[str, Any] = {"complete_final": True}


def finish_reason(reason: Any) -> Any:
    """An engine's finish reason in a form upstream's FinishReason accepts."""
    if reason is None or reason in _FINISH_REASONS:
        return reason
    if reason == "abort":
        return "cancelled"
    if isinstance(reason, str) and reason.startswith("error"):
        return reason if reason.startswith("error:") else "error: the engine reported an error"
    if isinstance(reason, dict) and isinstance(reason.get("error"), str):
        return reason
    # An engine-specific reason: the frontend knows none other; the output did end.
    return "stop"


def _full_usage(usage: Any) -> bool:
    return isinstance(usage, dict) and all(
        isinstance(usage.get(name), int) and usage[name] >= 0 for name in _USAGE_COUNTS
    )
