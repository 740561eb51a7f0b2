"""The system status server (aiohttp) on `DYN_SYSTEM_HOST:DYN_SYSTEM_PORT`.

Routes, with upstream's codes and bodies:
* `GET <health path>` and `GET <live path>` (one handler): 200 when healthy else 503, body
  the JSON text of `HealthState.body()` as text/plain;
* `GET /metrics`: Prometheus text, or 500 `Failed to get metrics`;
* `GET /metadata`: the discovery record (DiscoveryMetadata JSON), or 404
  `Discovery metadata not available`;
* any method on `/engine/{path}`: an empty body is `{}`; bad JSON is 400
  `{"error": "Invalid JSON", ...}`; an unknown path 404 `{"error": "Route not found", ...}`;
  a callback exception 500 `{"error": "Handler error", ...}`; else 200 with the answer;
* `/v1/loras` when LoRA management is enabled (see `loras.py`);
* `GET /v1/metadata/{namespace}/{component}/{endpoint}/{model_slug}/{model_suffix}/{filename}`:
  a file the published model cards name (see `card_files.py`), its raw bytes; a path not in
  the cards' allow-list is 404 `Not found`, a listed file that cannot be read 500
  `Failed to read file`;
* anything else: 404 `Route not found`.

With `admin_auth`, the mutating routes (`/engine/*`, `POST`/`DELETE /v1/loras`) answer only
callers the API server authorizes (see `auth.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from dynamo.runtime.card_files import ROUTE_PREFIX, CardFileKey
from dynamo.runtime.health import HealthState
from dynamo.runtime.metrics import RuntimeMetrics
from dynamo.runtime.system import auth
from dynamo.runtime.system.admin import EngineRoutes
from dynamo.runtime.system.loras import LoraRoutes

logger = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def compact_json(value: Any) -> str:
    """JSON without spaces, as upstream's serde writes it."""
    return json.dumps(value, separators=(",", ":"))


def json_response(body: Any, status: int = 200) -> web.Response:
    """A compact JSON response."""
    return web.json_response(body, status=status, dumps=compact_json)


MetadataSource = Callable[[], dict[str, Any] | None]
# The allow-list of card files (see card_files.allow_list), asked per request so that it
# follows the cards as adapters come and go.
CardFileSource = Callable[[], Awaitable[Mapping[CardFileKey, Path]]]
# Segment names as CardFileKey's fields. The file name takes the rest of the path, as
# upstream's `{*filename}` does (one with a '/' then simply matches no key).
CARD_FILE_ROUTE = (
    ROUTE_PREFIX + "/{namespace}/{component}/{endpoint}/{model_slug}/{model_suffix}/{filename:.+}"
)


async def _no_card_files() -> Mapping[CardFileKey, Path]:
    return {}


class SystemServer:
    """The worker's status and administration endpoint."""

    def __init__(
        self,
        *,
        health: HealthState,
        metrics: RuntimeMetrics,
        routes: EngineRoutes,
        metadata: MetadataSource,
        health_path: str = "/health",
        live_path: str = "/live",
        lora_enabled: bool = False,
        card_files: CardFileSource = _no_card_files,
        admin_auth: auth.AdminAuth | None = None,
    ) -> None:
        self._health = health
        self._metrics = metrics
        self._routes = routes
        self._metadata = metadata
        self._health_path = health_path
        self._live_path = live_path
        self._lora_enabled = lora_enabled
        self._card_files = card_files
        self._admin_auth = admin_auth
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application()
        if self._admin_auth is not None:
            auth.install(app, self._admin_auth)
        app.router.add_get(self._health_path, self._health_handler)
        if self._live_path != self._health_path:
            app.router.add_get(self._live_path, self._health_handler)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/metadata", self._metadata_handler)
        app.router.add_route("*", "/engine/{path:.*}", self._engine_handler)
        app.router.add_get(CARD_FILE_ROUTE, self._card_file_handler)
        if self._lora_enabled:
            LoraRoutes(self._routes).add_to(app)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0 = ephemeral); return the bound port."""
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        for address in self._runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                return int(address[1])
        raise RuntimeError("the system status server is not listening on a TCP port")

    async def stop(self) -> None:
        """Stop listening (idempotent)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _health_handler(self, request: web.Request) -> web.Response:
        del request
        body = self._health.body()
        status = 200 if body["status"] == "ready" else 503
        return web.Response(text=compact_json(body), status=status, content_type="text/plain")

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        del request
        try:
            text = self._metrics.exposition()
        except Exception:
            logger.exception("rendering /metrics failed")
            return web.Response(text="Failed to get metrics", status=500)
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _metadata_handler(self, request: web.Request) -> web.Response:
        del request
        metadata = self._metadata()
        if metadata is None:
            return web.Response(text="Discovery metadata not available", status=404)
        return json_response(metadata)

    async def _card_file_handler(self, request: web.Request) -> web.Response:
        key = CardFileKey(*(request.match_info[name] for name in CardFileKey._fields))
        # Only an exact key of the allow-list names a file: the URL is never a path.
        path = (await self._card_files()).get(key)
        if path is None:
            return web.Response(text="Not found", status=404)
        try:
            body = await asyncio.to_thread(path.read_bytes)
        except OSError:
            logger.exception("reading model-card file %s failed", path)
            return web.Response(text="Failed to read file", status=500)
        return web.Response(body=body, content_type="application/octet-stream")

    async def _engine_handler(self, request: web.Request) -> web.Response:
        path = request.match_info["path"]
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return json_response({"error": "Invalid JSON", "message": str(exc)}, status=400)
        callback = self._routes.get(path)
        if callback is None:
            return json_response(
                {"error": "Route not found", "message": f"Route /engine/{path} not found"},
                status=404,
            )
        try:
            result = await callback(body)
        except Exception as exc:
            logger.exception("/engine/%s failed", path)
            return json_response(
                {"error": "Handler error", "message": f"Python callback failed: {exc}"},
                status=500,
            )
        return json_response(result)

    async def _not_found(self, request: web.Request) -> web.Response:
        del request
        return web.Response(text="Route not found", status=404)
