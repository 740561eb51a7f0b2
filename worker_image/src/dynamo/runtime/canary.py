"""Canary health checks (`DYN_HEALTH_CHECK_ENABLED`): probe the engine when it is idle.

The endpoint starts notready. Whenever no request has succeeded for `DYN_CANARY_WAIT_TIME`
seconds, the canary payload goes through `engine.generate`; a first chunk without an error
within `DYN_HEALTH_CHECK_REQUEST_TIMEOUT` seconds makes the endpoint ready, anything else
notready. Real traffic that succeeds makes it ready too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from dynamo.common.backend.engine import BaseEngine
from dynamo.runtime.context import Context
from dynamo.runtime.health import HealthState

logger = logging.getLogger(__name__)


class Canary:
    """Probes one endpoint's engine while idle and records the result in `HealthState`."""

    def __init__(
        self,
        engine: BaseEngine,
        *,
        health: HealthState,
        endpoint: str,
        payload: dict[str, Any],
        wait_secs: float,
        timeout_secs: float,
    ) -> None:
        self._engine = engine
        self._health = health
        self._endpoint = endpoint
        self._payload = payload
        self._wait = wait_secs
        self._timeout = timeout_secs
        # Minus infinity: the first probe goes out at once.
        self._last_activity = float("-inf")
        self._task: asyncio.Task[None] | None = None
        health.register_target(endpoint)

    def record_success(self) -> None:
        """Real traffic succeeded: the endpoint is ready, and the next probe waits."""
        self._last_activity = time.monotonic()
        self._health.set_endpoint_ready(self._endpoint, True)

    def start(self) -> None:
        """Begin probing (first probe at once)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="canary")

    async def stop(self) -> None:
        """Stop probing (idempotent)."""
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            idle_for = time.monotonic() - self._last_activity
            if idle_for >= self._wait:
                self._health.set_endpoint_ready(self._endpoint, await self.probe())
                # A probe counts as activity: the next one comes after another idle period.
                self._last_activity = time.monotonic()
            else:
                await asyncio.sleep(self._wait - idle_for)

    async def probe(self) -> bool:
        """Send the payload once; True when the first chunk arrives in time without error."""
        context = Context(f"canary-{time.monotonic_ns()}")
        generator = self._engine.generate(dict(self._payload), context)  # type: ignore[attr-defined]
        try:
            chunk = await asyncio.wait_for(anext(generator), self._timeout)
            ok = isinstance(chunk, dict) and not chunk.get("error")
        except (TimeoutError, StopAsyncIteration):
            ok = False
        except Exception:
            logger.exception("canary probe of %s failed", self._endpoint)
            ok = False
        finally:
            context.stop_generating("canary")
            with contextlib.suppress(Exception):
                await generator.aclose()
            with contextlib.suppress(Exception):
                await self._engine.abort(context)
        if not ok:
            logger.warning(
                "canary probe of endpoint %s failed; marking it notready", self._endpoint
            )
        return ok
