"""Book-keeping of in-flight requests, for the drain at shutdown.

The drain has three steps: `refuse_new()` (new requests get 503), `wait_idle(budget)` (let
running requests finish), then for whatever is left `stop_all()` (each context is stopped,
which aborts it in the engine, and its stream ends "cancelled") and, if an engine ignores
that, `cancel_all()` (the request's task is cancelled; the handler still ends the stream
with a "cancelled" terminal).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from dynamo.runtime.context import Context
from dynamo.runtime.metrics import RequestObserver

DRAIN_REASON = "drain"


@dataclass(eq=False)
class InflightRequest:
    """One request being served."""

    context: Context
    task: asyncio.Task[object] | None = None
    # Set when the runtime itself cancelled the task (drain), as opposed to the client.
    forced: bool = field(default=False)
    # Its outcome and token timings, by model and adapter (set by `Serving.admitted`).
    observer: RequestObserver | None = None


class InflightTracker:
    """The set of in-flight requests and whether new ones are accepted."""

    def __init__(self) -> None:
        self._requests: set[InflightRequest] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.accepting = True

    def __len__(self) -> int:
        return len(self._requests)

    def begin(self, context: Context) -> InflightRequest:
        """Track a request served by the current task."""
        record = InflightRequest(context, asyncio.current_task())
        self._requests.add(record)
        self._idle.clear()
        return record

    def end(self, record: InflightRequest) -> None:
        """Stop tracking `record` (idempotent)."""
        self._requests.discard(record)
        if not self._requests:
            self._idle.set()

    def refuse_new(self) -> None:
        """From now on the request plane answers 503."""
        self.accepting = False

    async def wait_idle(self, seconds: float) -> bool:
        """Wait up to `seconds` for every request to finish; True if they did."""
        if not self._requests:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), seconds)
        return not self._requests

    def stop_all(self) -> int:
        """Stop every in-flight request (engine abort, stream ends "cancelled"); return how
        many there were."""
        records = list(self._requests)
        for record in records:
            record.context.stop_generating(DRAIN_REASON)
        return len(records)

    def cancel_all(self) -> int:
        """Cancel the tasks of requests that outlived `stop_all`; return how many."""
        records = [record for record in self._requests if record.task is not None]
        for record in records:
            record.forced = True
            assert record.task is not None
            record.task.cancel()
        return len(records)
