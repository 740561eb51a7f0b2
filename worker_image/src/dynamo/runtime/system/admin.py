"""Engine administrative routes: `/engine/control/<name>` and `/engine/update/<name>`.

Upstream's rules, for every route built here:
* the body must be a JSON object, else 200 `{"status": "error", "message": "engine control|update
  request body must be a JSON object"}`;
* outside the Running phase, 200 `{"status": "error", "message": "engine administrative routes
  are unavailable while the worker is starting|shutting down"}`;
* the engine's return value is the 200 body (even with `"status": "error"`); an exception
  becomes a 500 from the system server.

Controls that take the worker out of service (`pause_generation`, `sleep`,
`release_memory_occupation`) unregister it from discovery before the engine runs them; those
that bring it back (`resume_generation`, `wake_up`, `resume_memory_occupation`) re-register it
afterwards unless the engine answered with an error or `is_sleeping: true`. Such controls run
one at a time, and shutdown waits for the one in progress (`discovery_lock`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

logger = logging.getLogger(__name__)

STARTING: Final = "starting"
RUNNING: Final = "running"
SHUTTING_DOWN: Final = "shutting down"

UNREGISTER_BEFORE = frozenset({"pause_generation", "sleep", "release_memory_occupation"})
REREGISTER_AFTER = frozenset({"resume_generation", "wake_up", "resume_memory_occupation"})

RouteCallback = Callable[[Any], Awaitable[dict[str, Any]]]
EngineCall = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
DiscoveryCall = Callable[[], Awaitable[None]]


class Lifecycle:
    """The worker's phase as the admin routes see it."""

    def __init__(self) -> None:
        self.phase: str = STARTING


class EngineRoutes:
    """The `/engine/<path>` registry (upstream's `register_engine_route`)."""

    def __init__(self) -> None:
        self._routes: dict[str, RouteCallback] = {}

    def register(self, name: str, callback: RouteCallback) -> None:
        """Serve `callback` at `/engine/<name>`; a second registration replaces the first."""
        name = name.strip("/")
        if name in self._routes:
            logger.warning("engine route /engine/%s registered again; replacing it", name)
        self._routes[name] = callback

    def get(self, name: str) -> RouteCallback | None:
        """The callback for `/engine/<name>`, if any."""
        return self._routes.get(name.strip("/"))

    def names(self) -> list[str]:
        """Registered route names, sorted."""
        return sorted(self._routes)


def is_error_response(response: dict[str, Any]) -> bool:
    """Upstream's test for a failed control: `status` "error" (any case) or `success` false."""
    status = response.get("status")
    if isinstance(status, str) and status.lower() == "error":
        return True
    return response.get("success") is False


class AdminRoutes:
    """Builds the gated control/update callbacks for one engine."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        *,
        control: EngineCall,
        update: EngineCall,
        unregister: DiscoveryCall,
        register: DiscoveryCall,
        discovery_lock: asyncio.Lock | None = None,
    ) -> None:
        """`discovery_lock` serializes the discovery-changing controls with whatever else
        changes registration (startup, shutdown); a private lock when None."""
        self._lifecycle = lifecycle
        self._control = control
        self._update = update
        self._unregister = unregister
        self._register = register
        self.discovery_lock = discovery_lock or asyncio.Lock()

    def unavailable(self) -> dict[str, Any] | None:
        """The error body while the worker is not Running, else None."""
        if self._lifecycle.phase == RUNNING:
            return None
        return {
            "status": "error",
            "message": "engine administrative routes are unavailable while the worker is "
            f"{self._lifecycle.phase}",
        }

    def control_route(self, name: str) -> RouteCallback:
        """The callback for `/engine/control/<name>`."""

        async def handle(body: Any) -> dict[str, Any]:
            if not isinstance(body, dict):
                return _not_an_object("control")
            refused = self.unavailable()
            if refused is not None:
                return refused
            if name in UNREGISTER_BEFORE:
                return await self._control_out_of_service(name, body)
            if name in REREGISTER_AFTER:
                return await self._control_back_in_service(name, body)
            return await self._control(name, body)

        return handle

    def update_route(self, name: str) -> RouteCallback:
        """The callback for `/engine/update/<name>` (updates never touch discovery)."""

        async def handle(body: Any) -> dict[str, Any]:
            if not isinstance(body, dict):
                return _not_an_object("update")
            refused = self.unavailable()
            if refused is not None:
                return refused
            return await self._update(name, body)

        return handle

    async def _control_out_of_service(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.discovery_lock:
            if (refused := self.unavailable()) is not None:
                return refused
            try:
                await self._unregister()
            except Exception as exc:
                logger.exception("unregistering before /engine/control/%s failed", name)
                return {
                    "status": "error",
                    "message": f"failed to unregister endpoint before /engine/control/{name}: "
                    f"{exc}",
                }
            # An engine error leaves the worker unregistered, as upstream.
            return await self._control(name, body)

    async def _control_back_in_service(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.discovery_lock:
            if (refused := self.unavailable()) is not None:
                return refused
            response = await self._control(name, body)
            if is_error_response(response) or response.get("is_sleeping") is True:
                return response
            try:
                await self._register()
            except Exception as exc:
                logger.exception("re-registering after /engine/control/%s failed", name)
                return {
                    "status": "error",
                    "message": f"engine resumed but re-registration failed: {exc}; retry "
                    f"/engine/control/{name}",
                }
            return response


def _not_an_object(kind: str) -> dict[str, Any]:
    return {"status": "error", "message": f"engine {kind} request body must be a JSON object"}
