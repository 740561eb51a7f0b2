"""The activator's system server (the `system` port): probes, metrics and card files.

* `GET /health`, `GET /live`: 200 while the process runs.
* `GET /ready`: 200 once started (the activator serves requests from then on, holding
  them when no pod is ready); 503 while it shuts down.
* `GET /metrics`: Prometheus text (`ActivatorMetrics`).
* `GET /v1/metadata/<namespace>/<component>/<endpoint>/<slug>/<suffix>/<file>`: a captured
  card file (the route `dynamo.runtime.card_files` describes); 404 for any other key.

Nothing else: no route changes anything, so every other path is 404 and every other
method 405.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from dynamo.activator.cards import CapturedCards
from dynamo.activator.metrics import ActivatorMetrics
from dynamo.runtime.card_files import CardFileKey
from dynamo.runtime.system.server import CARD_FILE_ROUTE


class SystemServer:
    """The aiohttp application of the activator's system port."""

    def __init__(
        self,
        metrics: ActivatorMetrics,
        cards: Callable[[], CapturedCards | None],
        ready: Callable[[], bool],
    ) -> None:
        self._metrics = metrics
        self._cards = cards
        self._ready = ready

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._live)
        app.router.add_get("/live", self._live)
        app.router.add_get("/ready", self._ready_handler)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get(CARD_FILE_ROUTE, self._card_file)
        return app

    async def _live(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"status": "ok"})

    async def _ready_handler(self, request: web.Request) -> web.Response:
        del request
        if self._ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "shutting down"}, status=503)

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        del request
        response = web.Response(body=self._metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _card_file(self, request: web.Request) -> web.Response:
        key = CardFileKey(*(request.match_info[name] for name in CardFileKey._fields))
        cards = self._cards()
        body = cards.files.get(key) if cards is not None else None
        if body is None:
            return web.Response(text="Not found", status=404)
        return web.Response(body=body, content_type="application/octet-stream")
