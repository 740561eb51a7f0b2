"""The one resync loop, for both kinds: a kopf daemon per object runs it.

It reconciles once when it starts (kopf starts it when it first sees the object: a new one,
or every one when the operator starts), then whenever the object's trigger is set (after a
short debounce, so a burst of events such as pods becoming ready leads to one reconcile),
when the last reconcile asked to run again (a LoRAAdapter's backoff ending, a refused
request), and at least every resync period (a full pass, which repairs drift no watch
reports). Each pass holds one of the context's reconcile slots, and the trigger is cleared
only once the slot is held: whatever arrives while the object waits for one (a watch event, a
pod change, the resync) is coalesced into that one pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import kopf

from dynamo_operator.handlers.context import OperatorContext
from dynamo_operator.handlers.lifecycle import FINALIZER

DEBOUNCE_SECONDS = 0.2
# The shortest wait for a reconcile that asks to run again at once.
MIN_WAIT_SECONDS = 0.05
# How often a daemon looks again for kopf's finalizer (in the live body: no request).
FINALIZER_WAIT_SECONDS = 1.0

# One reconcile: `full` is False for a pass a trigger asked for between resyncs; returns the
# seconds until it wants to run again (None: at the next resync).
Reconcile = Callable[[bool], Awaitable[float | None]]


async def resync_loop(
    memo: OperatorContext,
    key: tuple[str, str, str],
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    reconcile: Reconcile,
) -> None:
    """Run `reconcile` for the object `key` (kind, namespace, name), whose live body is `body`,
    until `stopped`."""

    async def reconcile_finalized(full: bool) -> float | None:
        if FINALIZER not in (body.metadata.get("finalizers") or ()):
            return FINALIZER_WAIT_SECONDS  # kopf adds it at once unless the API fails
        return await reconcile(full)

    kind = key[0]
    trigger = memo.trigger(*key)
    memo.metrics.managed_objects.labels(kind=kind).inc()
    resync = memo.config.resync_seconds
    try:
        last_full = time.monotonic()
        async with memo.reconcile_slots:
            trigger.clear()
            wake = await reconcile_finalized(True)
        while not stopped:
            wait = last_full + resync - time.monotonic()
            if wake is not None:
                wait = min(wait, max(wake, MIN_WAIT_SECONDS))
            triggered = await _wait(trigger, stopped, max(wait, 0.0))
            if stopped:
                break
            await asyncio.sleep(DEBOUNCE_SECONDS)
            async with memo.reconcile_slots:
                if stopped:  # while it waited: kopf's deletion handler may run, no pass beside it
                    break
                trigger.clear()
                # A full pass when the resync is due, even while events keep coming.
                full = not triggered or time.monotonic() - last_full >= resync
                if full:
                    last_full = time.monotonic()
                wake = await reconcile_finalized(full)
    finally:
        memo.metrics.managed_objects.labels(kind=kind).dec()
        memo.metrics.forget_object(*key)
        memo.forget(*key)


async def _wait(trigger: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> bool:
    """Until the trigger is set, the daemon is stopped, or `seconds` pass; whether the
    trigger was set."""
    waiters = [
        asyncio.ensure_future(trigger.wait()),
        asyncio.ensure_future(stopped.wait()),
    ]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waiters, return_exceptions=True)
    return trigger.is_set()
