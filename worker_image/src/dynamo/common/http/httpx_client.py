"""httpx implementation of `HttpClient` (`DYN_HTTP_BACKEND=httpx`)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from .base import (
    HttpClient,
    HttpConnectionError,
    HttpStatusError,
    HttpTimeoutError,
)
from .config import HttpConfigBase
from .url_validator import describe_media_source

logger = logging.getLogger(__name__)


class HttpxClient(HttpClient):
    """httpx-backed concrete client."""

    def __init__(self, config: HttpConfigBase | None = None) -> None:
        super().__init__(config)
        self._client: httpx.AsyncClient | None = None
        # The client this object built and the loop it belongs to. A client assigned to
        # `_client` from outside (upstream's tests put a double there) is not in here.
        self._built: tuple[httpx.AsyncClient, asyncio.AbstractEventLoop] | None = None
        # The in-flight cap and the loop it serves (an asyncio.Semaphore binds to one loop).
        self._semaphore: tuple[asyncio.Semaphore, asyncio.AbstractEventLoop] | None = None

    def _timeout(self, read_timeout: float) -> httpx.Timeout:
        # The override targets `read` only: connect and pool keep their own budgets so a
        # stuck handshake or a saturated pool still fails fast. Fan-out GETs have no
        # meaningful write phase, so write is unbounded.
        override = self._config.per_call_timeout_override
        return httpx.Timeout(
            connect=self._config.connect_timeout,
            read=override if override is not None else read_timeout,
            write=None,
            pool=self._config.pool_timeout,
        )

    def _get_client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore[1] is not loop:
            # Back-pressure in front of the pool, so a burst waits here instead of
            # surfacing httpx PoolTimeout errors.
            self._semaphore = (asyncio.Semaphore(self._config.concurrency), loop)
        semaphore = self._semaphore[0]
        client = self._client
        # A client set on this object from outside is used as given. One built here belongs to
        # the loop that built it: reused from another loop (e.g. a second asyncio.run) it
        # is replaced below.
        built_for_another_loop = (
            self._built is not None and self._built[0] is client and self._built[1] is not loop
        )
        if client is not None and not client.is_closed and not built_for_another_loop:
            return client, semaphore
        client = httpx.AsyncClient(
            timeout=self._timeout(60.0),
            follow_redirects=True,
            limits=httpx.Limits(
                max_connections=self._config.max_connections,
                max_keepalive_connections=self._config.max_keepalive,
            ),
        )
        self._client = client
        self._built = (client, loop)
        return client, semaphore

    async def _fetch_simple(self, url: str, timeout_s: float) -> bytes:
        client, semaphore = self._get_client()
        async with semaphore:
            try:
                response = await client.get(url, timeout=self._timeout(timeout_s))
            except httpx.HTTPError as exc:
                raise _map_transport_error(exc, url) from exc
            _raise_for_error_status(response, url)
            return response.content

    async def _fetch_body_or_redirect(
        self, url: str, timeout_s: float
    ) -> tuple[bytes | None, str | None]:
        client, semaphore = self._get_client()
        async with semaphore:
            # Built and sent as two calls, as upstream's client does, so a client double
            # that stubs `build_request`/`send` drives this path the same way.
            request = client.build_request("GET", url, timeout=self._timeout(timeout_s))
            try:
                response = await client.send(request, follow_redirects=False)
            except httpx.HTTPError as exc:
                raise _map_transport_error(exc, url) from exc
            # `is_redirect` is any 3xx status (what a response double sets, not `status_code`);
            # without a Location it is a terminal response, as in the aiohttp backend.
            if response.is_redirect and (location := response.headers.get("location")):
                return None, str(response.url.join(location))
            _raise_for_error_status(response, url)
            return response.content, None

    async def close(self) -> None:
        """Close the client. Idempotent."""
        client, self._client = self._client, None
        self._built = None
        self._semaphore = None
        if client is not None and not client.is_closed:
            await client.aclose()


def _map_transport_error(exc: httpx.HTTPError, url: str) -> Exception:
    label = describe_media_source(url)
    if isinstance(exc, httpx.TimeoutException):
        return HttpTimeoutError(f"Timeout loading {label}")
    return HttpConnectionError(f"Connection error loading {label}: {exc}")


def _raise_for_error_status(response: httpx.Response, url: str) -> None:
    """Raise `HttpStatusError` for a 4xx/5xx response.

    The status is judged by httpx's `raise_for_status`, as upstream's client does (a response
    double stubs that, not `status_code`). It also refuses 1xx and 3xx; those stay terminal
    responses here, as in the aiohttp backend, so only 4xx/5xx are errors.
    """
    try:
        response.raise_for_status()
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        if status >= 400:
            raise HttpStatusError(status, exc.response.reason_phrase, url) from exc
