"""The per-request `Context`."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.common.backend.telemetry import current_span, start_span, trace_headers
from dynamo.runtime.context import Context

pytestmark = pytest.mark.unit


async def test_stop_fires_callbacks_once_and_wakes_waiters() -> None:
    context = Context("req-1", {"tenant": "a"})
    assert context.id() == "req-1"
    assert context.metadata == {"tenant": "a"}
    seen: list[str] = []
    context.add_stop_callback(lambda ctx: seen.append(ctx.id()))
    waiter = asyncio.create_task(context.async_killed_or_stopped())
    await asyncio.sleep(0)
    assert not waiter.done()
    context.stop_generating("drain")
    assert await asyncio.wait_for(waiter, 5) is True
    assert context.is_stopped()
    assert not context.is_killed()
    assert context.stop_reason == "drain"
    context.kill("client")
    assert context.is_killed()
    assert context.stop_reason == "drain"  # the first reason stays
    assert seen == ["req-1"]
    # Registering after the stop calls at once.
    context.add_stop_callback(lambda ctx: seen.append("late"))
    assert seen == ["req-1", "late"]
    assert await context.async_killed_or_stopped() is True


def test_ids_are_unique_and_tracing_is_a_no_op() -> None:
    first, second = Context(), Context()
    assert first.id() != second.id()
    assert first.trace_id is None
    assert first.span_id is None
    assert trace_headers(first) == {}
    with start_span(first, "step", n=1) as span:
        span.set_attribute("k", "v")
    current_span(first).add_event("e")


def test_failing_callback_does_not_break_others() -> None:
    context = Context()
    seen: list[int] = []

    def broken(ctx: Context) -> None:
        raise RuntimeError("boom")

    context.add_stop_callback(broken)
    context.add_stop_callback(lambda ctx: seen.append(1))
    context.kill()
    assert seen == [1]
