"""The activator's HTTP side (the worker Service's `http` port): hold, then reverse-proxy.

* `GET /v1/models` is answered at once from the captured cards (the worker's list shape).
* `GET /health`, `GET /live`: 200 while the process runs (probes).
* Every other request is held until a ready pod serves its model (`model` in a JSON body;
  none means any pod), then sent to that pod's HTTP port with its method, path, query,
  headers (hop-by-hop ones removed) and body. The pod's answer is streamed back chunk by
  chunk as it arrives, so SSE streams stay streams. A client that disconnects cancels its
  handler (aiohttp's handler cancellation), which closes the upstream request.
* A pod that refuses the connection, or answers 503 (draining) before anything was sent to
  the client, is skipped: the request goes to another ready pod or back into the hold.
* Refused (hold full), expired and shutdown requests get 503 with `Retry-After` and an
  OpenAI-shaped error body naming the DynamoWorker and what the request waited for.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from dynamo.activator.cards import CapturedCards
from dynamo.activator.hold import RETRY_AFTER_S, Hold, HoldError, HoldExpired, HoldFull
from dynamo.activator.pods import ReadyPod

log = logging.getLogger(__name__)

# RFC 9110 §7.6.1 connection-specific fields, plus those aiohttp recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
MAX_BODY_BYTES = 64 * 2**20


def forwardable(headers: Any) -> CIMultiDict[str]:
    """`headers` minus hop-by-hop fields and those the `Connection` field names."""
    named = {
        token.strip().lower()
        for value in headers.getall("Connection", [])
        for token in value.split(",")
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in HOP_BY_HOP and name.lower() not in named:
            out.add(name, value)
    return out


def error_response(status: int, message: str, error_type: str, code: str) -> web.Response:
    """An OpenAI-shaped error (`{"error": {...}}`) with `Retry-After`."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return web.json_response(body, status=status, headers={"Retry-After": str(RETRY_AFTER_S)})


def hold_error_response(exc: HoldError) -> web.Response:
    """The 503 for a request the hold could not place."""
    if isinstance(exc, HoldFull):
        return error_response(503, str(exc), "service_unavailable", "activator_hold_full")
    if isinstance(exc, HoldExpired):
        return error_response(503, str(exc), "service_unavailable", "activator_hold_timeout")
    return error_response(503, str(exc), "service_unavailable", "activator_shutting_down")


def requested_model(body: bytes, content_type: str) -> str | None:
    """The `model` of a JSON body, else None (any pod will do)."""
    if not body or "json" not in content_type:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) and model else None


class _Skip(Exception):
    """This pod cannot take the request now; try another."""


class HttpProxy:
    """The aiohttp application of the activator's HTTP port."""

    def __init__(
        self, hold: Hold, cards: Callable[[], CapturedCards | None], session: aiohttp.ClientSession
    ) -> None:
        self.hold = hold
        self._cards = cards
        self._session = session
        self._created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/live", self._health)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        del request
        cards = self._cards()
        if cards is None:
            return web.json_response({"object": "list", "data": []})
        return web.json_response(cards.listing(self._created))

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        ticket = self.hold.ticket(requested_model(body, request.content_type))
        tried: frozenset[str] = frozenset()
        while True:
            try:
                pod = await self.hold.wait(ticket, tried)
            except HoldError as exc:
                return hold_error_response(exc)
            try:
                return await self._proxy(request, body, pod, ticket)
            except _Skip as why:
                log.info(
                    "pod %s did not take %s %s: %s", pod.name, request.method, request.path, why
                )
                tried |= {pod.name}

    async def _proxy(
        self, request: web.Request, body: bytes, pod: ReadyPod, ticket: Any
    ) -> web.StreamResponse:
        try:
            upstream = await self._session.request(
                request.method,
                pod.http_url + request.path_qs,
                headers=forwardable(request.headers),
                data=body,
                allow_redirects=False,
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            )
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise _Skip(repr(exc)) from exc
        async with upstream:
            if upstream.status == 503:
                raise _Skip("HTTP 503 (draining)")
            self.hold.forwarded(ticket)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            response.headers.update(forwardable(upstream.headers))
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
