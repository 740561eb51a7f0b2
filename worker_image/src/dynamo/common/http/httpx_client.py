"""httpx implementation of `HttpClient` (`DYN_HTTP_BACKEND=httpx`)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from .base import (
    REDIRECT_STATUSES,
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
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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
        if (
            self._client is None
            or self._client.is_closed
            or self._semaphore is None
            or self._loop is not loop
        ):
            self._client = httpx.AsyncClient(
                timeout=self._timeout(60.0),
                follow_redirects=True,
                limits=httpx.Limits(
                    max_connections=self._config.max_connections,
                    max_keepalive_connections=self._config.max_keepalive,
                ),
            )
            # Back-pressure in front of the pool, so a burst waits here instead of
            # surfacing httpx PoolTimeout errors.
            self._semaphore = asyncio.Semaphore(self._config.concurrency)
            self._loop = loop
        return self._client, self._semaphore

    async def _fetch_simple(self, url: str, timeout_s: float) -> bytes:
        client, semaphore = self._get_client()
        async with semaphore:
            try:
                response = await client.get(url, timeout=self._timeout(timeout_s))
            except httpx.HTTPError as exc:
                raise _map_transport_error(exc, url) from exc
            if response.status_code >= 400:
                raise HttpStatusError(response.status_code, response.reason_phrase, url)
            return response.content

    async def _fetch_body_or_redirect(
        self, url: str, timeout_s: float
    ) -> tuple[bytes | None, str | None]:
        client, semaphore = self._get_client()
        async with semaphore:
            try:
                response = await client.get(
                    url, timeout=self._timeout(timeout_s), follow_redirects=False
                )
            except httpx.HTTPError as exc:
                raise _map_transport_error(exc, url) from exc
            location = response.headers.get("location")
            if response.status_code in REDIRECT_STATUSES and location:
                return None, str(response.url.join(location))
            if response.status_code >= 400:
                raise HttpStatusError(response.status_code, response.reason_phrase, url)
            return response.content, None

    async def close(self) -> None:
        """Close the client. Idempotent."""
        client, self._client = self._client, None
        self._semaphore = None
        if client is not None and not client.is_closed:
            await client.aclose()


def _map_transport_error(exc: httpx.HTTPError, url: str) -> Exception:
    label = describe_media_source(url)
    if isinstance(exc, httpx.TimeoutException):
        return HttpTimeoutError(f"Timeout loading {label}")
    return HttpConnectionError(f"Connection error loading {label}: {exc}")
