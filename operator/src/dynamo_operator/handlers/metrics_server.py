"""The operator's `/metrics` endpoint (Prometheus text format), served beside kopf."""

from __future__ import annotations

import logging

from aiohttp import web

from dynamo_operator.metrics import OperatorMetrics

logger = logging.getLogger(__name__)


async def serve_metrics(metrics: OperatorMetrics, host: str, port: int) -> web.AppRunner:
    """Serve `metrics` at http://host:port/metrics until the returned runner is cleaned up."""

    async def exposition(_: web.Request) -> web.Response:
        return web.Response(
            body=metrics.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    app = web.Application()
    app.add_routes([web.get("/metrics", exposition)])
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("Serving metrics at http://%s:%d/metrics", host, port)
    return runner
