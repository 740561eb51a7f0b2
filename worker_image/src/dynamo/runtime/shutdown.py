"""The shutdown orchestrator: upstream's order, with a drain in every mode.

On the first SIGTERM/SIGINT (`begin`, at once): the admin routes switch to "shutting down",
`/health` turns 503, the instance is unregistered from discovery, and the hard-deadline
watchdog starts (`DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT` + grace period, else exit 911).
Then (`run`):
1. wait for a discovery-changing control in progress, sleep the grace period
   (`DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS`): routers that have not yet seen the
   unregistration still get served;
2. drain, whatever the disaggregation mode (upstream drains prefill workers only): new
   requests get 503 with `Retry-After`; in-flight ones may finish within the drain budget
   (`DYN_PREFILL_DRAIN_TIMEOUT_S`, capped at the hard deadline minus 5 s); prefill workers
   then also poll `is_quiescent()` as upstream; whatever is left is aborted in the engine
   and ends with finish reason "cancelled". The time goes to `drain_time_seconds`, and a
   drain that had to abort goes to `dynamo_worker_drain_timeouts_exceeded_total`;
3. `engine.cleanup()` exactly once (`cleanup_time_seconds`);
4. close the request planes, the FPM socket, discovery and the system server.

The orchestrator sees the worker through `ShutdownSubject`, a handful of verbs, and is given
the engine, the in-flight tracker and the timings when it is built.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from dynamo.common.backend.engine import BaseEngine
from dynamo.runtime.inflight import InflightTracker
from dynamo.runtime.metrics import LifecycleGauges
from dynamo.runtime.settings import RuntimeSettings
from dynamo.runtime.watchdog import DeadlineWatchdog

logger = logging.getLogger(__name__)

# After the drain budget: how long aborted requests get to end their streams, then how long
# after their tasks were cancelled.
ABORT_WAIT_SECS = 2.0
FORCED_WAIT_SECS = 1.0
QUIESCENT_POLL_SECS = 0.5

# What to close last, in order: a name for the log, and a close that may be a coroutine.
Closer = tuple[str, Callable[[], Awaitable[None] | None]]


class ShutdownSubject(Protocol):
    """What shutdown needs from the worker it stops."""

    # The drain and cleanup gauges, once the engine started.
    gauges: LifecycleGauges | None

    def stop_admitting(self) -> None:
        """Admin routes answer "shutting down" and `/health` turns 503."""

    async def leave_discovery(self) -> None:
        """Unregister once (errors logged)."""

    async def stop_canary(self) -> None:
        """Stop the health-check canary, if any."""

    def closers(self) -> list[Closer]:
        """The servers and sockets to close, in order."""


class ShutdownOrchestrator:
    """Runs one worker's shutdown once."""

    def __init__(
        self,
        subject: ShutdownSubject,
        *,
        engine: BaseEngine,
        tracker: InflightTracker,
        settings: RuntimeSettings,
        prefill: bool,
    ) -> None:
        """`prefill`: also wait for `engine.is_quiescent()` after the drain (upstream)."""
        self._subject = subject
        self._engine = engine
        self._tracker = tracker
        self._settings = settings
        self._prefill = prefill
        self._cleaned = False
        self._unregister_task: asyncio.Task[None] | None = None
        self._watchdog: DeadlineWatchdog | None = None

    def begin(self) -> None:
        """The first signal: stop advertising at once and start the hard deadline."""
        self._watchdog = DeadlineWatchdog(self._settings.hard_deadline_secs)
        self._watchdog.arm()
        self._subject.stop_admitting()
        loop = asyncio.get_running_loop()
        self._unregister_task = loop.create_task(self._subject.leave_discovery())

    async def run(self, *, serving: bool) -> None:
        """Grace period, drain (when serving), cleanup, close everything."""
        await self._subject.stop_canary()
        if self._unregister_task is not None:
            await self._unregister_task
        grace = self._settings.grace_period_secs
        if grace > 0:
            logger.info("grace period: %.1f s before draining", grace)
            await asyncio.sleep(grace)
        if serving:
            await self.drain()
        await self.cleanup_once()
        await self.close_servers()
        if self._watchdog is not None:
            self._watchdog.disarm()
        logger.info("shutdown complete")

    async def drain(self) -> None:
        """Refuse new requests, let in-flight ones finish within budget, abort the rest."""
        tracker = self._tracker
        tracker.refuse_new()
        budget = self._settings.drain_budget_secs
        started = time.monotonic()
        logger.info("draining %d in-flight request(s) (budget %.1f s)", len(tracker), budget)
        drained = await tracker.wait_idle(budget)
        if drained and self._prefill:
            await self._wait_quiescent(started + budget)
        gauges = self._subject.gauges
        if not drained:
            if gauges is not None:
                gauges.drain_timeouts_exceeded.inc()
            count = tracker.stop_all()
            logger.warning(
                "drain budget of %.1f s spent; cancelling %d request(s) (finish reason "
                "'cancelled')",
                budget,
                count,
            )
            if not await tracker.wait_idle(ABORT_WAIT_SECS):
                logger.warning("%d request(s) ignored the abort; cancelling them", len(tracker))
                tracker.cancel_all()
                await tracker.wait_idle(FORCED_WAIT_SECS)
        elapsed = time.monotonic() - started
        if gauges is not None:
            gauges.drain_time.set(elapsed)
        logger.info("drain finished in %.2f s", elapsed)

    async def _wait_quiescent(self, deadline: float) -> None:
        # Upstream's prefill drain: KV transfers to decode peers may still be running.
        engine = self._engine
        last_log = time.monotonic()
        while time.monotonic() < deadline:
            try:
                if await engine.is_quiescent() is True:
                    return
            except Exception:
                logger.exception("is_quiescent failed; still waiting")
            if time.monotonic() - last_log >= 5.0:
                logger.info("waiting for the engine to become quiescent")
                last_log = time.monotonic()
            await asyncio.sleep(min(QUIESCENT_POLL_SECS, max(0.0, deadline - time.monotonic())))
        logger.warning("drain budget spent before the engine became quiescent")

    async def cleanup_once(self) -> None:
        """`engine.cleanup()`, exactly once; errors are logged."""
        if self._cleaned:
            return
        self._cleaned = True
        started = time.monotonic()
        try:
            await self._engine.cleanup()
        except Exception:
            logger.exception("engine.cleanup failed")
        elapsed = time.monotonic() - started
        gauges = self._subject.gauges
        if gauges is not None:
            gauges.cleanup_time.set(elapsed)
        logger.info("engine cleanup took %.2f s", elapsed)

    async def after_failed_start(self) -> None:
        """`start` raised: cleanup is still owed, then close what was opened."""
        await self.cleanup_once()
        await self.close_servers()

    async def close_servers(self) -> None:
        """Close what `closers()` names, in order (errors logged)."""
        for name, close in self._subject.closers():
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.exception("closing the %s failed", name)
