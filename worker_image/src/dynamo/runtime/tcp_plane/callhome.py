"""`ResponseStream`: one request's call-home connection to the frontend.

Per request the worker connects to the address the control message names (no pooling),
sends the handshake and the prologue, then one data-only frame per output, and ends with
`{"complete_final": true}` and the header-only `"sentinel"`. Meanwhile it reads what the
frontend sends: `"stop"` or `"kill"` (or the connection ending early) cancel the request,
which stops the engine through the request's `Context`; from then on nothing more is sent,
not even the end-of-stream frames. After the sentinel the frontend closes its side; the
worker waits for that (at most `LINGER_SECS`, as upstream) before closing its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from dynamo.runtime.context import Context
from dynamo.runtime.tcp_plane import messages
from dynamo.runtime.tcp_plane.codec import (
    FrameError,
    encode_payload,
    encode_two_part,
    read_two_part,
)
from dynamo.runtime.tcp_plane.messages import RequestControl

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECS = 5.0
LINGER_SECS = 10.0
# Control frames from the frontend are tiny; anything larger is a protocol error.
_MAX_CONTROL_BYTES = 64 * 1024
# The reason a request's Context records when the frontend cancels it.
CLIENT_REASON = "client"


class ResponseStream:
    """Writes one request's response frames and watches for the frontend's cancel."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        codec: str,
        context: Context,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = codec
        self._context = context
        self.cancelled = False  # the frontend stopped reading: send nothing more
        self._finished = False  # the sentinel went out
        self.sent_bytes = 0
        self._watcher = asyncio.get_running_loop().create_task(
            self._watch(), name=f"callhome-watch-{context.id()}"
        )

    @classmethod
    async def open(
        cls,
        control: RequestControl,
        context: Context,
        *,
        connect_timeout: float = CONNECT_TIMEOUT_SECS,
    ) -> ResponseStream:
        """Connect to the frontend and send the handshake and an OK prologue.

        OSError/TimeoutError when the frontend cannot be reached; ControlError for an
        address that is not `ip:port`.
        """
        host, port = messages.split_address(control.address)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), connect_timeout
        )
        # The prologue goes out at once: the engine is running, and a request-level failure
        # later travels in-band (HTTP 4xx/500) rather than as a prologue error, which the
        # frontend treats as this worker being down.
        writer.write(
            encode_two_part(header=messages.handshake(control.subject))
            + encode_two_part(header=messages.PROLOGUE_OK)
        )
        return cls(reader, writer, control.codec, context)

    async def send(self, item: Any) -> bool:
        """Send one stream item; False once the frontend cancelled or went away."""
        if self.cancelled:
            return False
        frame = encode_two_part(body=encode_payload(item, self._codec))
        try:
            self._writer.write(frame)
            await self._writer.drain()
        except (ConnectionError, RuntimeError):
            self._frontend_gone("the connection broke while sending")
            return False
        self.sent_bytes += len(frame)
        return True

    async def finish(self) -> None:
        """End the stream: `complete_final` and the sentinel (unless cancelled)."""
        if self.cancelled or self._finished:
            return
        end = encode_two_part(body=encode_payload(messages.COMPLETE_FINAL, self._codec))
        end += encode_two_part(header=messages.SENTINEL)
        try:
            self._writer.write(end)
            await self._writer.drain()
        except (ConnectionError, RuntimeError):
            self._frontend_gone("the connection broke while ending the stream")
            return
        self._finished = True
        self.sent_bytes += len(end)

    async def close(self, linger: float = LINGER_SECS) -> None:
        """Close the connection; after a finished stream, first wait (up to `linger`) for
        the frontend to close its side."""
        if self._finished and not self._watcher.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._watcher), linger)
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watcher
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()

    def abort(self) -> None:
        """Close the connection at once (the request's task is being cancelled)."""
        self.cancelled = True
        self._watcher.cancel()
        self._writer.close()

    async def _watch(self) -> None:
        try:
            while True:
                header, body = await read_two_part(self._reader, _MAX_CONTROL_BYTES)
                if body:
                    logger.warning(
                        "request %s: the frontend sent a data frame on the response stream; "
                        "ignoring it",
                        self._context.id(),
                    )
                    continue
                word = header.decode("utf-8", errors="replace").strip().strip('"')
                if word == messages.KILL:
                    self.cancelled = True
                    self._context.kill(CLIENT_REASON)
                elif word == messages.STOP:
                    self.cancelled = True
                    self._context.stop_generating(CLIENT_REASON)
                else:
                    logger.warning(
                        "request %s: unknown control frame %r on the response stream",
                        self._context.id(),
                        word,
                    )
        except (asyncio.IncompleteReadError, ConnectionError):
            self._frontend_gone("the frontend closed the response stream")
        except FrameError as exc:
            self._frontend_gone(f"unreadable frame on the response stream: {exc}")

    def _frontend_gone(self, why: str) -> None:
        if self._finished or self.cancelled:
            return  # the normal close after the sentinel, or already cancelled
        logger.debug("request %s: %s; cancelling it", self._context.id(), why)
        self.cancelled = True
        self._context.kill(CLIENT_REASON)
