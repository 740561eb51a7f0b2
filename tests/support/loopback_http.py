"""A real aiohttp server on a loopback address, for tests that make HTTP requests.

Tests may only send traffic to loopback, so every server here binds 127.0.0.0/8 or ::1
with an OS-chosen port. The server records each request path it receives, which lets a
test prove that a refused URL was never requested.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from dynamo.common.http import UrlValidationPolicy, close_http_client


@pytest.fixture
async def closed_default_http_client() -> AsyncIterator[None]:
    """Close the process-wide HTTP client after the test. The media loaders fetch through
    it, and its session belongs to the test's event loop: left open, it is collected
    unclosed (aiohttp warns) once the next test's loop replaces it, or at exit."""
    yield
    await close_http_client()


@dataclass
class LoopbackHttpServer:
    """A running server: where it listens and which paths it was asked for."""

    host: str
    port: int
    requests: list[str] = field(default_factory=list)

    def url(self, path: str = "/") -> str:
        """`http://host:port/path` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/{path.lstrip('/')}"


@asynccontextmanager
async def serve(app: web.Application, host: str = "127.0.0.1") -> AsyncIterator[LoopbackHttpServer]:
    """Run `app` on `host` (a loopback address) until the block exits."""
    server = LoopbackHttpServer(host=host, port=0)

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        server.requests.append(request.path_qs)
        return await handler(request)

    app.middlewares.append(record)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    server.port = runner.addresses[0][1]
    try:
        yield server
    finally:
        await runner.cleanup()


def loopback_policy(**resolved: list[str]) -> UrlValidationPolicy:
    """An SSRF policy that lets a test reach 127.0.0.1 (and nothing else internal).

    `http://` is allowed and 127.0.0.1/32 is exempt from the blocked ranges; every other
    rule of the default policy stays on. Host names resolve only through `resolved`.
    """

    async def resolver(host: str) -> list[str]:
        if host not in resolved:
            raise socket.gaierror(socket.EAI_NONAME, f"unknown test host {host!r}")
        return resolved[host]

    return UrlValidationPolicy(
        allow_http=True,
        allowed_networks=(ipaddress.ip_network("127.0.0.1/32"),),
        resolver=resolver,
    )


def media_app(files: dict[str, bytes]) -> web.Application:
    """Serves `files` at `/media/<name>` and redirects `/redirect?to=<url>` anywhere."""

    async def media(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in files:
            raise web.HTTPNotFound()
        return web.Response(body=files[name], content_type="application/octet-stream")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    app = web.Application()
    app.router.add_get("/media/{name}", media)
    app.router.add_get("/redirect", redirect)
    return app
