"""Byte framing of upstream Dynamo's TCP request plane and call-home response plane.

All integers are big-endian.

* Two-part message (every request payload and every response-plane frame): a 24-byte prefix
  of three u64, `header length`, `body length`, `checksum`, then the header bytes, then the
  body bytes. Release builds of upstream write checksum 0 and only verify a non-zero one, so
  we write 0 and ignore what we read. "Header-only" (body length 0) carries control text;
  "data-only" (header length 0) carries a stream item.
* Request frame (frontend -> worker, pipelined on pooled connections): `u16` endpoint-path
  length, the path, `u16` headers length, the headers (a JSON object of strings), `u32`
  payload length, the payload (one two-part message).
* ACK (worker -> frontend, on the same connection, one per request frame, in arrival order):
  `u32` length and that many bytes; empty means accepted, `Server unavailable: ...` or
  `Server overloaded: ...` refuse the request.
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass
from typing import Any

import msgspec

TWO_PART_PREFIX = struct.Struct(">QQQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

# Upstream's defaults: DYN_TCP_MAX_MESSAGE_SIZE for a whole request frame.
DEFAULT_MAX_MESSAGE_BYTES = 32 * 2**20

ACCEPTED = _U32.pack(0)
UNAVAILABLE_PREFIX = "Server unavailable: "
OVERLOADED_PREFIX = "Server overloaded: "

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder()
CODECS = ("msgpack", "json")


class FrameError(ValueError):
    """Bytes that do not follow the framing (the connection cannot continue)."""


@dataclass(frozen=True)
class RequestFrame:
    """One request as it arrived: the endpoint path, the headers and the two-part payload."""

    path: str
    headers: dict[str, str]
    payload: bytes


def encode_two_part(header: bytes = b"", body: bytes = b"") -> bytes:
    """A two-part message with checksum 0."""
    return TWO_PART_PREFIX.pack(len(header), len(body), 0) + header + body


def decode_two_part(message: bytes) -> tuple[bytes, bytes]:
    """`(header, body)` of a complete two-part message; FrameError when the lengths lie."""
    if len(message) < TWO_PART_PREFIX.size:
        raise FrameError(f"two-part message of {len(message)} bytes is shorter than its prefix")
    header_len, body_len, _checksum = TWO_PART_PREFIX.unpack_from(message)
    end = TWO_PART_PREFIX.size + header_len + body_len
    if end != len(message):
        raise FrameError(
            f"two-part message declares {header_len}+{body_len} bytes after its prefix but "
            f"carries {len(message) - TWO_PART_PREFIX.size}"
        )
    start = TWO_PART_PREFIX.size
    return message[start : start + header_len], message[start + header_len : end]


async def read_two_part(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bytes]:
    """Read one two-part message from a stream; IncompleteReadError at EOF."""
    prefix = await reader.readexactly(TWO_PART_PREFIX.size)
    header_len, body_len, _checksum = TWO_PART_PREFIX.unpack(prefix)
    if header_len + body_len > max_bytes:
        raise FrameError(f"two-part message of {header_len + body_len} bytes exceeds {max_bytes}")
    header = await reader.readexactly(header_len) if header_len else b""
    body = await reader.readexactly(body_len) if body_len else b""
    return header, body


def encode_request_frame(path: str, headers: dict[str, str], payload: bytes) -> bytes:
    """A request frame (what the frontend sends; used by tests and tools)."""
    path_bytes = path.encode("utf-8")
    header_bytes = json.dumps(headers, separators=(",", ":")).encode("utf-8")
    return (
        _U16.pack(len(path_bytes))
        + path_bytes
        + _U16.pack(len(header_bytes))
        + header_bytes
        + _U32.pack(len(payload))
        + payload
    )


async def read_request_frame(
    reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> RequestFrame | None:
    """The next request frame, or None when the peer closed the connection between frames.

    FrameError for malformed bytes or a frame over `max_bytes`; IncompleteReadError when the
    connection ends inside a frame.
    """
    try:
        first = await reader.readexactly(_U16.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    (path_len,) = _U16.unpack(first)
    path_bytes = await reader.readexactly(path_len)
    (headers_len,) = _U16.unpack(await reader.readexactly(_U16.size))
    headers_bytes = await reader.readexactly(headers_len)
    (payload_len,) = _U32.unpack(await reader.readexactly(_U32.size))
    if payload_len + path_len + headers_len > max_bytes:
        raise FrameError(
            f"request frame of {payload_len + path_len + headers_len} bytes exceeds the "
            f"{max_bytes}-byte limit (DYN_TCP_MAX_MESSAGE_SIZE)"
        )
    payload = await reader.readexactly(payload_len)
    try:
        path = path_bytes.decode("utf-8")
        headers = json.loads(headers_bytes) if headers_bytes else {}
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"request frame has an unreadable path or headers: {exc}") from None
    if not isinstance(headers, dict):
        raise FrameError("request frame headers are not a JSON object")
    return RequestFrame(path, {str(k): str(v) for k, v in headers.items()}, payload)


def encode_ack(refusal: str = "") -> bytes:
    """The ACK for one request: empty (accepted) or a refusal text."""
    if not refusal:
        return ACCEPTED
    data = refusal.encode("utf-8")
    return _U32.pack(len(data)) + data


async def read_ack(reader: asyncio.StreamReader) -> str:
    """One ACK's text ("" = accepted); used by tests and tools."""
    (length,) = _U32.unpack(await reader.readexactly(_U32.size))
    return (await reader.readexactly(length)).decode("utf-8") if length else ""


def encode_payload(value: Any, codec: str) -> bytes:
    """`value` in the request plane codec `codec` ("msgpack" or "json")."""
    if codec == "msgpack":
        return _msgpack_encoder.encode(value)
    if codec == "json":
        return _json_encoder.encode(value)
    raise ValueError(f"payload codec {codec!r} is not one of {CODECS}")


def decode_payload(data: bytes, codec: str) -> Any:
    """The inverse of `encode_payload`; msgspec.DecodeError for bad bytes."""
    if codec == "msgpack":
        return _msgpack_decoder.decode(data)
    if codec == "json":
        return _json_decoder.decode(data)
    raise ValueError(f"payload codec {codec!r} is not one of {CODECS}")
