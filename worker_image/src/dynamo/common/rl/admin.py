"""Worker admin routes used by RL trainers (weight updates, LoRA load/unload, pausing).

Routes are registered on the system status server as `/engine/<name>`; optionally a
registry lets a request-plane endpoint describe them (`{"method": "routes"}`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

# Wider than `dynamo.common.utils.env.env_bool`: values are stripped and "on" counts.
TRUE_ENV_VALUES = frozenset({"1", "true", "yes", "on"})

RLRouteHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]
EndpointGenerator = Callable[[dict[str, Any]], AsyncGenerator[dict[str, Any] | None, None]]

_OK: dict[str, Any] = {"status": "ok"}


class RLAdminValidationError(ValueError):
    """Validation error whose message can be returned directly to RL clients."""


def env_bool(name: str, default: bool = False) -> bool:
    """Parse a boolean environment variable using Dynamo's common true values."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in TRUE_ENV_VALUES


async def first_endpoint_response(
    endpoint_handler: EndpointGenerator, body: dict[str, Any]
) -> dict[str, Any]:
    """Return the first response from an async-generator endpoint handler.

    The generator is closed before returning, so handlers that hold resources across
    their yield (e.g. a per-LoRA lock) release them promptly instead of at garbage
    collection. A handler that yields None or nothing answers `{"status": "ok"}`.
    """
    generator = endpoint_handler(body)
    try:
        async for item in generator:
            return dict(_OK) if item is None else item
        return dict(_OK)
    finally:
        await generator.aclose()


def _require_string(value: object, message: str) -> str:
    if not isinstance(value, str) or not value:
        raise RLAdminValidationError(message)
    return value


def require_lora_load_request(request: Mapping[str, Any] | None) -> tuple[str, str]:
    """Validate the shared URI-based LoRA load request shape; return `(lora_name, uri)`.

    Expected body: `{"lora_name": str, "source": {"uri": str}}`.
    """
    if not isinstance(request, Mapping):
        raise RLAdminValidationError("Request is required with 'lora_name' and 'source.uri'")
    lora_name = _require_string(
        request.get("lora_name"), "'lora_name' is required and must be a string"
    )
    source = request.get("source")
    if not isinstance(source, Mapping):
        raise RLAdminValidationError("'source' object is required in request")
    uri = _require_string(source.get("uri"), "'source.uri' is required and must be a string")
    return lora_name, uri


def require_lora_unload_request(request: Mapping[str, Any] | None) -> str:
    """Validate the shared LoRA unload request shape (`{"lora_name": str}`); return the name."""
    if not isinstance(request, Mapping):
        raise RLAdminValidationError("Request is required with 'lora_name' field")
    return _require_string(request.get("lora_name"), "'lora_name' is required and must be a string")


class RLRouteRegistry:
    """Registry for worker RL admin route descriptors."""

    def __init__(self, runtime: Any, *, logger_: logging.Logger | None = None) -> None:
        self.runtime = runtime
        self.routes: dict[str, RLRouteHandler] = {}
        self._logger = logger_ or logger

    def add_route(self, name: str, handler: RLRouteHandler) -> None:
        """Record one route (a later registration under the same name replaces it)."""
        self.routes[name] = handler

    def add_routes(self, routes: Mapping[str, RLRouteHandler]) -> None:
        """Record several routes."""
        for name, handler in routes.items():
            self.add_route(name, handler)

    def describe(self) -> dict[str, Any]:
        """Return `{"status": "ok", "routes": [...sorted names], "system_url"?: str}`.

        `system_url` is included only when the runtime can report its system server URL.
        """
        description: dict[str, Any] = {"status": "ok", "routes": sorted(self.routes)}
        system_url_fn = getattr(self.runtime, "system_status_server_url", None)
        if callable(system_url_fn):
            try:
                system_url = system_url_fn()
            except Exception:
                self._logger.warning("Could not read the system status server URL", exc_info=True)
                system_url = None
            if system_url:
                description["system_url"] = system_url
        return description

    async def dispatch(self, request: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Answer a request-plane RL request; only `{"method": "routes"}` is supported."""
        if not isinstance(request, Mapping):
            return {"status": "error", "message": "rl_dispatch: request required"}
        method = request.get("method")
        if not isinstance(method, str) or not method:
            return {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}
        if method != "routes":
            return {
                "status": "error",
                "method": method,
                "message": "rl request-plane endpoint only supports method='routes'",
            }
        kwargs = request.get("kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            return {
                "status": "error",
                "method": method,
                "message": "rl_dispatch: 'kwargs' must be an object",
            }
        return self.describe()

    async def dispatch_stream(
        self, request: Mapping[str, Any] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Streaming form of `dispatch` for request-plane handlers: yields one response."""
        yield await self.dispatch(request)


def register_rl_routes(
    runtime: Any,
    registry: RLRouteRegistry,
    routes: Mapping[str, RLRouteHandler],
    *,
    enable_dispatch: bool,
) -> None:
    """Register worker system routes and optionally expose route descriptors.

    Each route becomes `/engine/<name>` on the system status server (no `control/`
    prefix); with `enable_dispatch` it is also recorded in `registry`.
    """
    for name, handler in routes.items():
        runtime.register_engine_route(name, handler)
        if enable_dispatch:
            registry.add_route(name, handler)
