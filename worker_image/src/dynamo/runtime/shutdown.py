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
   and ends with finish reason "cancelled". The time goes to `drain_time_seconds`;
3. `engine.cleanup()` exactly once (`cleanup_time_seconds`);
4. close the request planes, the FPM socket, discovery and the system server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from dynamo.common.constants import DisaggregationMode
from dynamo.runtime.admin import SHUTTING_DOWN
from dynamo.runtime.watchdog import DeadlineWatchdog

if TYPE_CHECKING:
    from dynamo.runtime.lifecycle import WorkerRuntime

logger = logging.getLogger(__name__)

# After the drain budget: how long aborted requests get to end their streams, then how long
# after their tasks were cancelled.
ABORT_WAIT_SECS = 2.0
FORCED_WAIT_SECS = 1.0
QUIESCENT_POLL_SECS = 0.5


class ShutdownOrchestrator:
    """Runs a `WorkerRuntime`'s shutdown once."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self._runtime = runtime
        self._cleaned = False
        self._unregister_task: asyncio.Task[None] | None = None
        self._watchdog: DeadlineWatchdog | None = None

    def begin(self) -> None:
        """The first signal: stop advertising at once and start the hard deadline."""
        runtime = self._runtime
        self._watchdog = DeadlineWatchdog(runtime.settings.hard_deadline_secs)
        self._watchdog.arm()
        runtime.lifecycle.phase = SHUTTING_DOWN
        runtime.health.set_system_ready(False)
        runtime.health.set_endpoint_ready(runtime.config.endpoint, False)
        self._unregister_task = asyncio.get_running_loop().create_task(self._unregister())

    async def _unregister(self) -> None:
        runtime = self._runtime
        try:
            async with runtime.discovery_lock:
                if runtime.registered:
                    await runtime.discovery.unregister()
                    runtime.registered = False
                    logger.info("unregistered from discovery")
        except Exception:
            logger.exception("unregistering from discovery failed")

    async def run(self, *, serving: bool) -> None:
        """Grace period, drain (when serving), cleanup, close everything."""
        runtime = self._runtime
        if runtime.canary is not None:
            await runtime.canary.stop()
        if self._unregister_task is not None:
            await self._unregister_task
        grace = runtime.settings.grace_period_secs
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
        runtime = self._runtime
        tracker = runtime.tracker
        tracker.refuse_new()
        budget = runtime.settings.drain_budget_secs
        started = time.monotonic()
        logger.info("draining %d in-flight request(s) (budget %.1f s)", len(tracker), budget)
        drained = await tracker.wait_idle(budget)
        if drained and runtime.config.disaggregation_mode is DisaggregationMode.PREFILL:
            await self._wait_quiescent(started + budget)
        if not drained:
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
        if runtime.gauges is not None:
            runtime.gauges.drain_time.set(elapsed)
        logger.info("drain finished in %.2f s", elapsed)

    async def _wait_quiescent(self, deadline: float) -> None:
        # Upstream's prefill drain: KV transfers to decode peers may still be running.
        engine = self._runtime.engine
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
            await self._runtime.engine.cleanup()
        except Exception:
            logger.exception("engine.cleanup failed")
        elapsed = time.monotonic() - started
        if self._runtime.gauges is not None:
            self._runtime.gauges.cleanup_time.set(elapsed)
        logger.info("engine cleanup took %.2f s", elapsed)

    async def after_failed_start(self) -> None:
        """`start` raised: cleanup is still owed, then close what was opened."""
        await self.cleanup_once()
        await self.close_servers()

    async def close_servers(self) -> None:
        """Stop the request planes, FPM, discovery and the system server (errors logged)."""
        runtime = self._runtime
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        if runtime.tcp_plane is not None:
            steps.append(("TCP request plane", runtime.tcp_plane.stop))
        if runtime.request_plane is not None:
            steps.append(("request plane", runtime.request_plane.stop))
        steps.append(("discovery", runtime.discovery.close))
        if runtime.system_server is not None:
            steps.append(("system server", runtime.system_server.stop))
        if runtime.fpm is not None:
            runtime.fpm.close()
        if runtime.event_plane is not None:
            runtime.event_plane.close()
        for name, step in steps:
            try:
                await step()
            except Exception:
                logger.exception("closing the %s failed", name)
