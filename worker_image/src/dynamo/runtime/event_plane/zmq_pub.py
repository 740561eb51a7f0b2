"""`ZmqEventPublisher`: one topic of upstream Dynamo's ZMQ event plane.

The publisher binds a PUB socket and is advertised by an EventChannel discovery record
(`instance_id` = this publisher's id). Subscribers (upstream's frontend and KV router)
connect and subscribe to the topic. Every message has four frames:

1. the topic, UTF-8;
2. the publisher id, u64 big-endian (it must equal the channel record's `instance_id`);
3. the sequence number, u64 big-endian, from 0, +1 per message;
4. `[u8 version = 1][u32 BE length][envelope]`, the envelope a msgpack map
   `{publisher_id, sequence, published_at (ms since the epoch), topic, payload}` whose
   `payload` is msgpack *bin*: the msgpack encoding of the topic's own message.

Readers drop a message whose envelope disagrees with frames 1-3. `publish` may be called
from any thread and never blocks (a subscriber that lags loses messages, as with any PUB
socket; subscribers that join late miss earlier ones).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

FRAME_VERSION = 1
_U64 = struct.Struct(">Q")
_HEADER = struct.Struct(">BI")
_encoder = msgspec.msgpack.Encoder()


def encode_message(topic: str, publisher_id: int, sequence: int, body: Any) -> list[bytes]:
    """The four frames of one event-plane message carrying `body` (any msgpack value)."""
    envelope = _encoder.encode(
        {
            "publisher_id": publisher_id,
            "sequence": sequence,
            "published_at": int(time.time() * 1000),
            "topic": topic,
            # bytes encode as msgpack bin, as readers require.
            "payload": _encoder.encode(body),
        }
    )
    return [
        topic.encode("utf-8"),
        _U64.pack(publisher_id),
        _U64.pack(sequence),
        _HEADER.pack(FRAME_VERSION, len(envelope)) + envelope,
    ]


class ZmqEventPublisher:
    """A bound PUB socket for one topic and one publisher id."""

    def __init__(
        self,
        topic: str,
        publisher_id: int,
        *,
        bind_host: str,
        advertised_host: str,
        on_dropped: Callable[[], None] | None = None,
    ):
        """Bind `tcp://<bind_host>:<free port>`; `endpoint` is what the channel advertises.
        `on_dropped` is called for each message dropped (subscribers lag, or closed)."""
        self.topic = topic
        self.publisher_id = publisher_id
        self._on_dropped = on_dropped
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._socket.bind(f"tcp://{bind_host}:*")
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise OSError(
                f"cannot bind the {topic} event socket on {bind_host}: {exc}; set "
                "DYN_EVENT_PLANE_HOST to an address of this host"
            ) from exc
        port = self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        shown = f"[{advertised_host}]" if ":" in advertised_host else advertised_host
        self.endpoint = f"tcp://{shown}:{port}"
        self._sequence = 0
        self._lock = threading.Lock()
        self._closed = False

    def publish(self, body: Any) -> None:
        """Send one message (dropped when closed)."""
        with self._lock:
            if self._closed:
                self._dropped()
                return
            frames = encode_message(self.topic, self.publisher_id, self._sequence, body)
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.debug("%s: subscribers lag; message %d dropped", self.topic, self._sequence)
                self._dropped()
            self._sequence += 1

    def _dropped(self) -> None:
        if self._on_dropped is not None:
            self._on_dropped()

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._socket.close()
            self._context.term()
