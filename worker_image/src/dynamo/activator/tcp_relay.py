"""The activator's side of upstream Dynamo's TCP request plane: hold, then relay to a pod.

Choice: the activator *terminates* the call-home stream and pipes the pod's stream through,
rather than relaying the request frame so that the pod calls the frontend home itself.
Observed with upstream 1.6.1's frontend (file discovery, a fake worker on loopback):

* ACK a request and never call home, then close the request connection (what the kernel
  does when a process is killed): the frontend's HTTP client still had no answer after 90 s.
  A relayed frame leaves exactly that window open while the request is held.
* Call home and send only the handshake, then close: the frontend answers 503 at once.
* Handshake, then the prologue 20 s or 70 s later: the frontend waits and streams normally.

So per request the activator ACKs at once, calls the frontend home at once and sends the
handshake, and holds the prologue back while the request is held: if the activator dies
then, the frontend sees the connection close and fails the request at once. Once a ready pod
serves the request's model, the activator sends the pod the same control message and body
(the endpoint path is the pod's; the call-home address is the activator's own call-home
listener, under a fresh subject), and from the pod's call home on copies frames both ways
unchanged: the pod's prologue, items and sentinel to the frontend, the frontend's
`stop`/`kill` to the pod. Either side closing early closes the other. A pod that refuses the
request in its ACK (draining) or cannot be reached is skipped: another ready pod, or back
into the hold.

On timeout (and at shutdown) the frontend gets an OK prologue followed by an in-band error
item of upstream's kind `Unavailable`: observed, 1.6.1 answers a unary request with HTTP 503
and a stream with an error event of code 503, and keeps routing to the activator. (A prologue
error also gives 503, but the frontend then takes the instance out of routing for about 4 s,
during which new requests fail instead of being held; the message text is not shown to
clients either way, so the activator logs it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

import msgspec

from dynamo.activator.hold import Hold, HoldError
from dynamo.activator.pods import ReadyPod
from dynamo.runtime.tcp_plane import codec, messages
from dynamo.runtime.tcp_plane.codec import FrameError, RequestFrame
from dynamo.runtime.tcp_plane.messages import ControlError, RequestControl

log = logging.getLogger(__name__)

UNAVAILABLE: Any = "Unavailable"  # upstream's error kind the frontend answers with 503
CONNECT_TIMEOUT_S = 5.0
CALL_HOME_TIMEOUT_S = 30.0  # from a pod's ACK to its call home
_MAX_FRAME = 1 << 26


class _Skip(Exception):
    """This pod did not take the request; try another."""


class TcpRelay:
    """Listens for the frontend's request frames; holds, then relays each to a pod."""

    def __init__(self, hold: Hold, advertised_host: str) -> None:
        self.hold = hold
        self.advertised_host = advertised_host  # where pods call the activator home
        self._server: asyncio.Server | None = None
        self._callhome: asyncio.Server | None = None
        self._callhome_address = ""
        self._expected: dict[
            str, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        ] = {}
        self._connections: set[asyncio.StreamWriter] = set()
        self._requests: set[asyncio.Task[None]] = set()
        self._accepting = True

    async def start(self, host: str, port: int) -> int:
        """Listen for requests on `host:port` and for pods' call homes on an ephemeral port;
        the request port."""
        self._callhome = await asyncio.start_server(self._pod_called_home, host, 0)
        callhome_port = self._callhome.sockets[0].getsockname()[1]
        shown = f"[{self.advertised_host}]" if ":" in self.advertised_host else self.advertised_host
        self._callhome_address = f"{shown}:{callhome_port}"
        self._server = await asyncio.start_server(self._connection, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting; held requests are answered by the hold's close (call it first);
        relayed ones get `grace_s` to finish."""
        self._accepting = False
        for server in (self._server, self._callhome):
            if server is not None:
                server.close()
        if self._requests:
            _done, pending = await asyncio.wait(set(self._requests), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for writer in list(self._connections):
            writer.close()

    # ----- the frontend's request connections ---------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while True:
                try:
                    frame = await codec.read_request_frame(reader)
                except (FrameError, asyncio.IncompleteReadError, ConnectionError) as exc:
                    log.warning("closing a request-plane connection: %s", exc)
                    return
                if frame is None:
                    return
                if not self._accepting:
                    writer.write(
                        codec.encode_ack(codec.UNAVAILABLE_PREFIX + "activator shutting down")
                    )
                else:
                    writer.write(codec.ACCEPTED)
                    task = asyncio.get_running_loop().create_task(self._serve(frame))
                    self._requests.add(task)
                    task.add_done_callback(self._requests.discard)
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _serve(self, frame: RequestFrame) -> None:
        try:
            header, body = codec.decode_two_part(frame.payload)
            control = messages.parse_control(header)
            raw_control = json.loads(header)
        except (FrameError, ControlError, ValueError) as exc:
            log.error("cannot serve a request from the frontend: %s", exc)
            return
        try:
            host, port = messages.split_address(control.address)
            front_r, front_w = await asyncio.wait_for(
                asyncio.open_connection(host, port), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError, ControlError) as exc:
            log.warning(
                "request %s: cannot call home to %s: %s", control.request_id, control.address, exc
            )
            return
        try:
            # The handshake now, the prologue only once a pod answers (see the docstring).
            front_w.write(codec.encode_two_part(header=messages.handshake(control.subject)))
            await front_w.drain()
            await self._hold_and_relay(frame, control, raw_control, body, front_r, front_w)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            log.info("request %s: the frontend went away: %r", control.request_id, exc)
        finally:
            front_w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await front_w.wait_closed()

    async def _hold_and_relay(
        self,
        frame: RequestFrame,
        control: RequestControl,
        raw_control: dict[str, Any],
        body: bytes,
        front_r: asyncio.StreamReader,
        front_w: asyncio.StreamWriter,
    ) -> None:
        ticket = self.hold.ticket(_model_of(body, control.codec))
        # While held, anything from the frontend (kill, stop, EOF) ends the request.
        gone = asyncio.ensure_future(front_r.read(1))
        tried: frozenset[str] = frozenset()
        try:
            while True:
                waiting = asyncio.ensure_future(self.hold.wait(ticket, tried))
                await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not waiting.done():
                    waiting.cancel()
                    with contextlib.suppress(asyncio.CancelledError, HoldError):
                        await waiting
                    log.info("request %s: the frontend cancelled it while held", control.request_id)
                    return
                if gone.done():  # the frontend left (or sent kill) as the pod came up
                    log.info("request %s: the frontend cancelled it while held", control.request_id)
                    return
                try:
                    pod = waiting.result()
                except HoldError as exc:
                    log.warning("request %s: %s", control.request_id, exc)
                    await _fail(front_w, control.codec, str(exc))
                    return
                try:
                    pod_r, pod_w = await self._forward(frame, raw_control, body, pod)
                except _Skip as why:
                    log.info(
                        "request %s: pod %s did not take it: %s", control.request_id, pod.name, why
                    )
                    tried |= {pod.name}
                    continue
                self.hold.forwarded(ticket)
                break
        finally:
            if not gone.done():
                gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await _pipe(pod_r, pod_w, front_r, front_w)

    async def _forward(
        self, frame: RequestFrame, raw_control: dict[str, Any], body: bytes, pod: ReadyPod
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Send the request to `pod`; the pod's call-home connection (handshake read)."""
        if pod.tcp_address is None:
            raise _Skip("it serves no TCP request plane")
        hostport, _sep, path = pod.tcp_address.partition("/")
        subject = str(uuid.uuid4())
        control = dict(raw_control)
        info = _info(control)
        info.update(address=self._callhome_address, subject=subject)
        control["connection_info"] = {"transport": "tcp_server", "info": json.dumps(info)}
        payload = codec.encode_two_part(json.dumps(control).encode("utf-8"), body)
        arrived = asyncio.get_running_loop().create_future()
        self._expected[subject] = arrived
        try:
            try:
                host, port = messages.split_address(hostport)
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), CONNECT_TIMEOUT_S
                )
            except (OSError, TimeoutError, ControlError) as exc:
                raise _Skip(repr(exc)) from exc
            try:
                writer.write(codec.encode_request_frame(path, dict(frame.headers), payload))
                await writer.drain()
                ack = await asyncio.wait_for(codec.read_ack(reader), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, FrameError) as exc:
                raise _Skip(f"no ACK: {exc!r}") from exc
            finally:
                writer.close()  # one request per connection; the pod's task outlives it
            if ack:
                raise _Skip(ack)
            try:
                return await asyncio.wait_for(arrived, CALL_HOME_TIMEOUT_S)
            except TimeoutError as exc:
                raise _Skip("it accepted the request but never called home") from exc
        finally:
            self._expected.pop(subject, None)

    async def _pod_called_home(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            header, _body = await asyncio.wait_for(
                codec.read_two_part(reader, 64 * 1024), CONNECT_TIMEOUT_S
            )
            subject = json.loads(header).get("subject")
        except (
            OSError,
            TimeoutError,
            asyncio.IncompleteReadError,
            FrameError,
            ValueError,
            AttributeError,
        ):
            writer.close()
            return
        waiter = self._expected.get(subject) if isinstance(subject, str) else None
        if waiter is None or waiter.done():
            writer.close()
            return
        waiter.set_result((reader, writer))


def _info(control: dict[str, Any]) -> dict[str, Any]:
    info = control.get("connection_info", {}).get("info")
    parsed = json.loads(info) if isinstance(info, str) else dict(info or {})
    return dict(parsed)


def _model_of(body: bytes, codec_name: str) -> str | None:
    """The model a PreprocessedRequest asks for: its LoRA adapter, else its `model`."""
    try:
        request = codec.decode_payload(body, codec_name)
    except (msgspec.DecodeError, ValueError):
        return None
    if not isinstance(request, dict):
        return None
    routing = request.get("routing")
    lora = routing.get("lora_name") if isinstance(routing, dict) else None
    model = lora or request.get("model")
    return model if isinstance(model, str) and model else None


async def _fail(writer: asyncio.StreamWriter, codec_name: str, message: str) -> None:
    """An OK prologue, then an `Unavailable` error item and the end of the stream."""
    item = messages.error_item(message, UNAVAILABLE)
    writer.write(
        codec.encode_two_part(header=messages.PROLOGUE_OK)
        + codec.encode_two_part(body=codec.encode_payload(item, codec_name))
        + codec.encode_two_part(body=codec.encode_payload(messages.COMPLETE_FINAL, codec_name))
        + codec.encode_two_part(header=messages.SENTINEL)
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()


async def _copy(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, until_sentinel: bool
) -> bool:
    """Copy two-part messages unchanged; True when the sentinel passed."""
    while True:
        try:
            header, body = await codec.read_two_part(reader, _MAX_FRAME)
        except (asyncio.IncompleteReadError, ConnectionError, FrameError):
            return False
        writer.write(codec.encode_two_part(header, body))
        try:
            await writer.drain()
        except ConnectionError:
            return False
        if until_sentinel and not body and header.strip() == messages.SENTINEL:
            return True


async def _pipe(
    pod_r: asyncio.StreamReader,
    pod_w: asyncio.StreamWriter,
    front_r: asyncio.StreamReader,
    front_w: asyncio.StreamWriter,
) -> None:
    """Pod to frontend until the sentinel (or either side breaks), frontend to pod meanwhile."""
    down = asyncio.ensure_future(_copy(pod_r, front_w, until_sentinel=True))
    up = asyncio.ensure_future(_copy(front_r, pod_w, until_sentinel=False))
    try:
        await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
        if down.done() and down.result():
            # The stream is complete: the frontend closes its side, then we close ours.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(up), 10.0)
    finally:
        for task in (down, up):
            task.cancel()
        await asyncio.gather(down, up, return_exceptions=True)
        pod_w.close()
