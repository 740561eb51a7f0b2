"""Run one request through `engine.generate` with upstream's stream guarantees.

* Exactly one terminal chunk (the one with `finish_reason`), nothing after it; an engine
  that ends without one is reported as `StreamIncomplete`.
* When the request's context is stopped (drain, client gone, stop string) the engine is
  asked to `abort(context)` once; its next terminal is passed on ("abort" normalized to
  "cancelled"). An engine still streaming `ABORT_GRACE_SECS` after the stop is cut off with a
  synthesized "cancelled" terminal, and so is a request whose task the drain cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

from dynamo.common.backend.engine import BaseEngine
from dynamo.runtime.context import Context
from dynamo.runtime.inflight import InflightRequest

logger = logging.getLogger(__name__)

ABORT_GRACE_SECS = 1.0
CANCELLED = "cancelled"


class StreamIncomplete(RuntimeError):
    """The engine's stream ended without a terminal chunk."""


def cancelled_terminal() -> dict[str, Any]:
    """The terminal chunk the runtime sends for a request it cut off (a `GenerateChunk`)."""
    return {"token_ids": [], "index": 0, "finish_reason": CANCELLED}


class EngineStreamer:
    """Streams engine output for requests and aborts stopped ones in the engine."""

    def __init__(self, engine: BaseEngine) -> None:
        self._engine = engine
        self._aborts: set[asyncio.Task[None]] = set()

    def watch(self, context: Context) -> None:
        """Call `engine.abort(context)` once when the context is stopped or killed."""
        context.add_stop_callback(self._abort)

    def _abort(self, context: Context) -> None:
        task = asyncio.get_running_loop().create_task(self._engine.abort(context))
        self._aborts.add(task)
        task.add_done_callback(self._abort_done)

    def _abort_done(self, task: asyncio.Task[None]) -> None:
        self._aborts.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("engine.abort failed", exc_info=task.exception())

    async def stream(
        self, request: dict[str, Any], context: Context, record: InflightRequest, *, raw: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yield the engine's chunks for `request` (see the module docstring)."""
        generator = self._engine.generate(request, context)  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        # Once the context is stopped, the engine has ABORT_GRACE_SECS in all to finish.
        cutoff: float | None = None
        try:
            while True:
                try:
                    if context.is_stopped():
                        if cutoff is None:
                            cutoff = loop.time() + ABORT_GRACE_SECS
                        remaining = cutoff - loop.time()
                        if remaining <= 0:
                            raise TimeoutError
                        chunk = await asyncio.wait_for(anext(generator), remaining)
                    else:
                        chunk = await anext(generator)
                except StopAsyncIteration:
                    if raw:
                        return
                    if context.is_stopped():
                        yield _cancelled(record)
                        return
                    raise StreamIncomplete(
                        "the engine's stream ended without a terminal chunk (finish_reason)"
                    ) from None
                except TimeoutError:
                    logger.warning(
                        "engine kept streaming request %s after abort; cutting it off",
                        context.id(),
                    )
                    yield _cancelled(record)
                    return
                except asyncio.CancelledError:
                    if not record.forced:
                        raise
                    uncancel()
                    yield _cancelled(record)
                    return
                if raw:
                    yield chunk
                    continue
                tokens = chunk.get("token_ids")
                if tokens and record.observer is not None:
                    record.observer.tokens(len(tokens))
                reason = chunk.get("finish_reason")
                if reason is None:
                    yield chunk
                    continue
                if reason in ("abort", CANCELLED):
                    chunk = _cancelled(record, chunk)
                yield chunk
                return
        finally:
            await _close(generator)


def _cancelled(record: InflightRequest, terminal: dict[str, Any] | None = None) -> dict[str, Any]:
    """`terminal` (default: a synthesized one) ending "cancelled", the request's outcome."""
    if record.observer is not None:
        record.observer.cancelled = True
    if terminal is None:
        return cancelled_terminal()
    return {**terminal, "finish_reason": CANCELLED}


def uncancel() -> None:
    """Take back every cancellation requested of the current task (after handling a
    drain's forced cancellation, so the task can still finish its stream)."""
    task = asyncio.current_task()
    if task is not None:
        while task.cancelling():
            task.uncancel()


async def _close(generator: Any) -> None:
    try:
        await generator.aclose()
    except Exception:
        logger.exception("closing the engine's generator failed")
