"""Stream a response with the engine decoupled from the socket.

A producer task runs the engine and encodes each chunk straight into a shared
`OutputBuffer`; the request's handler is the writer: it takes everything buffered and sends
it in one transport write (one system call, one HTTP chunk).

Pacing: a write is followed by at most one more within `flush_interval`. Bytes that arrive
when the last write is older than that (the first chunk, and every chunk of an engine whose
tokens are further apart, i.e. any real model) are written at once; bytes that arrive
sooner wait for the rest of the interval and go out together with whatever else came
meanwhile (so the added latency is below the interval). Without this pause nothing would
ever coalesce: an engine that emits one token per event-loop pass (a zero-cost engine under
load) hands the writer exactly one chunk per pass, and one system call per token costs more
than producing the token. The writer also writes at once when the producer ends or the
buffer is full.

The buffer is bounded: once `limit` bytes wait, the producer (and so the engine's request)
pauses until the writer takes them, so a slow client cannot make memory grow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from dynamo.runtime.generation import uncancel
from dynamo.runtime.inflight import InflightRequest

# Bytes a producer may have waiting before it pauses (about a thousand token chunks).
BUFFER_LIMIT = 1 << 16
# Seconds between two writes of one response while chunks keep coming: far below a real
# engine's inter-token latency (so its chunks go out one by one, at once), long enough that
# a zero-cost engine's chunks go out some twenty to a write.
FLUSH_INTERVAL_SECS = 0.001


class OutputBuffer:
    """Bytes one producer has encoded and one writer has not sent yet."""

    __slots__ = ("_space_waiter", "_wake_on_add", "_writer_waiter", "data", "limit")

    def __init__(self, limit: int = BUFFER_LIMIT) -> None:
        # The producer appends to `data` in place (`Encoder.encode_into(obj, data, -1)`,
        # `data += ...`), then calls `added()`; `take()` swaps in a new bytearray.
        self.data = bytearray()
        self.limit = limit
        self._writer_waiter: asyncio.Future[None] | None = None
        self._wake_on_add = False
        self._space_waiter: asyncio.Future[None] | None = None

    def full(self) -> bool:
        """True when the producer must wait for the writer."""
        return len(self.data) >= self.limit

    def added(self) -> Awaitable[None] | None:
        """Tell the writer there are bytes. Returns an awaitable when the buffer is full:
        the producer awaits it before adding more; else None (no await on the hot path)."""
        if not self.full():
            if self._wake_on_add:
                self.wake_writer()
            return None
        self.wake_writer()
        self._space_waiter = asyncio.get_running_loop().create_future()
        return self._space_waiter

    def wake_writer(self) -> None:
        """Wake the writer if it waits (also called when the producer ends)."""
        waiter, self._writer_waiter = self._writer_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, until: float | None) -> None:
        """The writer's wait: for the next bytes (`until` None), or else until the loop's
        clock reaches `until`; either way also for the producer's end or a full buffer."""
        loop = asyncio.get_running_loop()
        self._writer_waiter = waiter = loop.create_future()
        self._wake_on_add = until is None
        timer = None if until is None else loop.call_at(until, self.wake_writer)
        try:
            await waiter
        finally:
            self._wake_on_add = False
            if timer is not None:
                timer.cancel()

    def take(self) -> bytearray:
        """Everything buffered (the writer's side); a paused producer may go on."""
        data, self.data = self.data, bytearray()
        waiter, self._space_waiter = self._space_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return data


async def write_coalesced(
    response: web.StreamResponse,
    buffer: OutputBuffer,
    produce: Coroutine[Any, Any, bool],
    record: InflightRequest,
    on_write: Callable[[int], None],
    *,
    flush_interval: float = FLUSH_INTERVAL_SECS,
) -> bool:
    """Run `produce` (which fills `buffer`) in its own task and write what it produces to
    the prepared `response` as described in the module docstring; end the response.

    Returns what `produce` returned. `on_write(n)` is called for each write of n bytes. A
    cancelled handler (client gone) cancels the producer; a drain's forced cancellation
    (`record.forced`) is passed on to the producer instead, which then ends its stream with
    a terminal chunk that is still written.
    """
    loop = asyncio.get_running_loop()
    producer = loop.create_task(produce)
    producer.add_done_callback(lambda _: buffer.wake_writer())
    next_write = loop.time()
    try:
        while True:
            try:
                now = loop.time()
                done = producer.done()
                if buffer.data and (done or now >= next_write or buffer.full()):
                    data = buffer.take()
                    next_write = now + flush_interval
                    on_write(len(data))
                    if done:
                        await response.write_eof(bytes(data))
                        return producer.result()
                    await response.write(data)
                elif done:
                    await response.write_eof()
                    return producer.result()
                else:
                    # Within the interval after a write, sleep it out (bytes gather);
                    # after it, wake for the first new bytes.
                    await buffer.wait(next_write if now < next_write else None)
            except asyncio.CancelledError:
                if not record.forced or producer.done():
                    raise
                # The drain cancelled this request: the producer (the engine's side) ends
                # the stream with a "cancelled" terminal, which is still written.
                uncancel()
                producer.cancel()
    finally:
        if not producer.done():
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
