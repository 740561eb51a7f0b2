"""`TcpRequestPlane`: serves upstream Dynamo's TCP request plane for one engine.

Each accepted connection carries pipelined request frames. Every frame is ACKed at once, in
arrival order (the frontend matches ACKs first in, first out): accepted, or refused with
`Server unavailable:` for an unknown endpoint path or while the worker drains. An accepted
request then runs in its own task: decode the control message and the body, call home
(`ResponseStream`), and stream the engine's chunks through the `Serving` the HTTP request
plane is given too, so the engine contract, abort-on-cancel, the drain and the metrics are
the same on both planes. Failures travel in-band: a bad request is upstream's
`InvalidArgument` (the frontend answers 400), an engine error `Unknown` (500).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec

from dynamo.runtime.context import Context
from dynamo.runtime.errors import RequestError
from dynamo.runtime.inflight import InflightRequest
from dynamo.runtime.serving import Serving
from dynamo.runtime.tcp_plane import messages
from dynamo.runtime.tcp_plane.callhome import ResponseStream
from dynamo.runtime.tcp_plane.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    UNAVAILABLE_PREFIX,
    FrameError,
    RequestFrame,
    decode_payload,
    decode_two_part,
    encode_ack,
    read_request_frame,
)
from dynamo.runtime.tcp_plane.messages import ControlError, RequestControl

logger = logging.getLogger(__name__)

DRAINING = UNAVAILABLE_PREFIX + "the worker is shutting down; route to another worker"


class TcpRequestPlane:
    """Listens for the frontend's request frames and answers on call-home streams."""

    def __init__(
        self,
        serving: Serving,
        *,
        endpoint_path: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """`endpoint_path` is the path advertised in the Endpoint record (requests carrying
        another path are refused)."""
        self.serving = serving
        self.endpoint_path = endpoint_path
        self._metrics = serving.metrics
        self._max_bytes = max_message_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._requests: set[asyncio.Task[None]] = set()

    # ----- listener ----------------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0 = ephemeral); return the bound port."""
        self._server = await asyncio.start_server(self._connection, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening, close every connection and cancel leftover requests (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._connections):
            writer.close()
        tasks = list(self._requests)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    frame = await read_request_frame(reader, self._max_bytes)
                except (FrameError, asyncio.IncompleteReadError, ConnectionError) as exc:
                    logger.warning("closing request-plane connection from %s: %s", peer, exc)
                    return
                if frame is None:
                    return
                refusal = self._refusal(frame)
                # ACK before any work, so ACKs leave in the order the frames arrived.
                writer.write(encode_ack(refusal))
                if refusal:
                    self._metrics.count_error("unavailable")
                else:
                    task = asyncio.get_running_loop().create_task(self._serve(frame))
                    self._requests.add(task)
                    task.add_done_callback(self._requests.discard)
                await writer.drain()
        except ConnectionError:
            logger.debug("request-plane connection from %s broke", peer)
        finally:
            self._connections.discard(writer)
            writer.close()

    def _refusal(self, frame: RequestFrame) -> str:
        if frame.path != self.endpoint_path:
            return f"{UNAVAILABLE_PREFIX}unknown endpoint {frame.path}"
        if not self.serving.tracker.accepting:
            return DRAINING
        return ""

    # ----- one request -------------------------------------------------------------------

    async def _serve(self, frame: RequestFrame) -> None:
        try:
            header, body = decode_two_part(frame.payload)
            control = messages.parse_control(header)
        except (FrameError, ControlError) as exc:
            # Without a readable control message there is nowhere to answer (upstream, too,
            # only logs this); the frontend's request stays unanswered.
            self._metrics.count_error("invalid_argument")
            logger.error("cannot serve a request from the frontend: %s", exc)
            return
        metrics = self._metrics
        context = Context(control.request_id, metadata=control.metadata)
        stream: ResponseStream | None = None
        with self.serving.admitted(context) as record:
            metrics.request_bytes.inc(len(frame.payload))
            try:
                try:
                    stream = await ResponseStream.open(control, context)
                except (OSError, TimeoutError, ControlError) as exc:
                    self.serving.failed(record, "cannot_connect")
                    logger.warning(
                        "request %s: cannot call home to %s: %s",
                        context.id(),
                        control.address,
                        exc,
                    )
                    context.kill("client")
                    return
                await self._respond(stream, body, control, context, record)
            except asyncio.CancelledError:
                if stream is not None:
                    stream.abort()
                raise
            finally:
                if stream is not None:
                    metrics.response_bytes.inc(stream.sent_bytes)
        # Outside the in-flight record: the request is done, only the socket lingers.
        if stream is not None:
            await stream.close()

    async def _respond(
        self,
        stream: ResponseStream,
        body: bytes,
        control: RequestControl,
        context: Context,
        record: InflightRequest,
    ) -> None:
        try:
            request = decode_payload(body, control.codec)
            engine_request = request if self.serving.raw else self._engine_request(record, request)
        except (msgspec.DecodeError, RequestError) as exc:
            self.serving.failed(record, "invalid_argument")
            message = f"request body is not valid {control.codec}: {exc}"
            if isinstance(exc, RequestError):
                message = str(exc)
            await stream.send(messages.error_item(message, messages.INVALID_ARGUMENT))
            await stream.finish()
            return
        serving = self.serving
        serving.streamer.watch(context)
        to_item = messages.raw_item if serving.raw else messages.output_item
        completed = False
        try:
            chunks = serving.streamer.stream(engine_request, context, record, raw=serving.raw)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if not await stream.send(to_item(chunk)):
                        break
                else:
                    completed = True
        except RequestError as exc:
            serving.failed(record, "invalid_argument")
            await stream.send(messages.error_item(str(exc), messages.INVALID_ARGUMENT))
        except Exception as exc:
            serving.engine_failed(exc, record)
            await stream.send(messages.error_item(f"engine error: {exc}"))
        if stream.cancelled:
            serving.cancelled(record)
        await stream.finish()
        if completed and not stream.cancelled:
            serving.succeeded()

    def _engine_request(self, record: InflightRequest, request: Any) -> dict[str, Any]:
        """Upstream's PreprocessedRequest as our engine's GenerateRequest: the same fields,
        with `model` resolved to the base model or a loaded adapter and the token budget
        applied (the frontend enforces it too, from the model card)."""
        if not isinstance(request, dict):
            raise RequestError("the request body must be a map (upstream's PreprocessedRequest)")
        token_ids = request.get("token_ids")
        if not isinstance(token_ids, list):
            raise RequestError("'token_ids' must be an array of integers", param="token_ids")
        routing = request.get("routing")
        lora = routing.get("lora_name") if isinstance(routing, dict) else None
        return self.serving.token_request(record, request, token_ids, lora or request.get("model"))
