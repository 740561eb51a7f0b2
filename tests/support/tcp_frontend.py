"""A minimal stand-in for upstream's frontend side of the TCP request plane, for unit tests.

It speaks the frontend's half of the protocol with the runtime's own codec helpers: request
frames on one pipelined connection (ACKs read in order), and a call-home server that
collects each response stream (handshake, prologue, items, end). Tests against the real
frontend live in tests/e2e/test_upstream_frontend.py; this one lets the protocol details
(ordering, cancel, refusals) be checked without it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from dynamo.runtime.tcp_plane import codec


@dataclass
class CallHome:
    """One response stream as the frontend saw it."""

    subject: str
    handshake: Any = None
    prologue: Any = None
    items: list[Any] = field(default_factory=list)
    complete_final: bool = False
    sentinel: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    kill_after: int | None = None  # send "kill" after this many items
    close_after: int | None = None  # just close the connection after this many items

    def outputs(self) -> list[dict[str, Any]]:
        """The LLMEngineOutput of every data item."""
        return [item["data"]["data"] for item in self.items if "data" in item.get("data", {})]

    def token_ids(self) -> list[int]:
        return [token for output in self.outputs() for token in output.get("token_ids", [])]


class FakeFrontend:
    """Sends requests to a TCP request plane and collects the call-home streams."""

    def __init__(self, codec_name: str = "msgpack") -> None:
        self.codec = codec_name
        self.streams: dict[str, CallHome] = {}
        self._server: asyncio.Server | None = None
        self.address = ""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._call_home, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def connect(self, port: int) -> None:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", port)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._server is not None:
            self._server.close()

    def expect(self, kill_after: int | None = None, close_after: int | None = None) -> CallHome:
        """Register a response stream for the next request."""
        stream = CallHome(subject=str(uuid.uuid4()), kill_after=kill_after, close_after=close_after)
        self.streams[stream.subject] = stream
        return stream

    def frame(
        self, path: str, body: Any, stream: CallHome, *, codec_name: str | None = None
    ) -> bytes:
        """A request frame for `body`, answered on `stream`."""
        name = codec_name or self.codec
        request_id = str(uuid.uuid4())
        info = {
            "address": self.address,
            "subject": stream.subject,
            "context": request_id,
            "stream_type": "response",
        }
        control: dict[str, Any] = {
            "id": request_id,
            "request_type": "single_in",
            "response_type": "many_out",
            "connection_info": {"transport": "tcp_server", "info": json.dumps(info)},
        }
        if codec_name != "absent":
            control["payload_codec"] = name
        payload_codec = "json" if name == "absent" else name
        payload = codec.encode_two_part(
            json.dumps(control).encode(), codec.encode_payload(body, payload_codec)
        )
        headers = {"request-id": request_id, "x-endpoint-path": path}
        return codec.encode_request_frame(path, headers, payload)

    async def send(self, *frames: bytes) -> list[str]:
        """Send frames back to back (pipelined); the ACK texts, in order."""
        assert self._writer is not None
        assert self._reader is not None
        self._writer.write(b"".join(frames))
        await self._writer.drain()
        return [await codec.read_ack(self._reader) for _ in frames]

    async def _call_home(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream: CallHome | None = None
        try:
            header, _ = await codec.read_two_part(reader, 1 << 20)
            handshake = json.loads(header)
            stream = self.streams[handshake["subject"]]
            stream.handshake = handshake
            header, _ = await codec.read_two_part(reader, 1 << 20)
            stream.prologue = json.loads(header)
            killed = False
            while True:  # until the sentinel, or the worker closes after a kill
                header, body = await codec.read_two_part(reader, 1 << 24)
                if header:
                    stream.sentinel = json.loads(header) == "sentinel"
                    break  # the frontend closes its side after the sentinel
                item = codec.decode_payload(body, self.codec)
                if item.get("complete_final"):
                    stream.complete_final = True
                    continue
                stream.items.append(item)
                if stream.close_after is not None and len(stream.items) >= stream.close_after:
                    break
                kill_after = stream.kill_after
                if not killed and kill_after is not None and len(stream.items) >= kill_after:
                    killed = True
                    writer.write(codec.encode_two_part(header=b'"kill"'))
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            if stream is not None:
                stream.closed.set()
