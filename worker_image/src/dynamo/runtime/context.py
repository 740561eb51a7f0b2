"""`Context`: the per-request handle an engine's `generate` receives.

It mirrors upstream's Python `Context`: `id()`, `is_stopped()`, `is_killed()`,
`stop_generating()`, `kill()`, `async_killed_or_stopped()`, `metadata` and the tracing
accessors (no tracing backend here, so they return nothing and the
`dynamo.common.backend.telemetry` helpers fall back to no-op spans).

`stop_generating()` asks the engine to finish early (it should end the stream with finish
reason "cancelled"); `kill()` means nobody reads the output any more (client gone). Either
one fires the stop callbacks once; the runtime uses that to call `engine.abort(context)`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

StopCallback = Callable[["Context"], None]


class Context:
    """One request's identity, cancellation state and metadata."""

    __slots__ = ("_callbacks", "_event", "_id", "_killed", "_stopped", "metadata", "stop_reason")

    def __init__(self, request_id: str | None = None, metadata: dict[str, Any] | None = None):
        self._id = request_id or uuid.uuid4().hex
        self._stopped = False
        self._killed = False
        self._event: asyncio.Event | None = None
        self._callbacks: list[StopCallback] = []
        self.metadata: dict[str, Any] = dict(metadata or {})
        # Why the request was stopped: "client", "drain", "stop" (stop string), or None.
        self.stop_reason: str | None = None

    def id(self) -> str:
        """The request id (the `x-request-id` header when the client sent one)."""
        return self._id

    def is_stopped(self) -> bool:
        """True once `stop_generating()` or `kill()` was called."""
        return self._stopped

    def is_killed(self) -> bool:
        """True once `kill()` was called: the output has no reader any more."""
        return self._killed

    def stop_generating(self, reason: str | None = None) -> None:
        """Ask the engine to stop this request soon (it ends with finish reason cancelled)."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._set_stopped()

    def kill(self, reason: str | None = None) -> None:
        """Stop immediately: the client is gone and nothing more will be read."""
        self._killed = True
        if self.stop_reason is None:
            self.stop_reason = reason
        self._set_stopped()

    async def async_killed_or_stopped(self) -> bool:
        """Wait until the request is stopped or killed; returns True."""
        if not self._stopped:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()
        return True

    def add_stop_callback(self, callback: StopCallback) -> None:
        """Call `callback(context)` once when the request is first stopped or killed (at
        once when it already is)."""
        if self._stopped:
            callback(self)
        else:
            self._callbacks.append(callback)

    def notify_first_token(self) -> None:
        """Upstream's time-to-first-token hook; nothing to do without a tracing backend."""

    @property
    def trace_id(self) -> str | None:
        """No tracing backend: always None."""
        return None

    @property
    def span_id(self) -> str | None:
        """No tracing backend: always None."""
        return None

    def trace_headers(self) -> dict[str, str]:
        """W3C trace headers to propagate; empty without a tracing backend."""
        return {}

    def current_span(self) -> Any:
        """The request's span; None without a tracing backend."""
        return None

    def start_span(self, name: str, attributes: dict[str, Any] | None = None) -> Any:
        """A child span; None without a tracing backend."""
        del name, attributes
        return None

    def _set_stopped(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("stop callback for request %s failed", self._id)
