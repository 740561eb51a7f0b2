"""aiohttp implementation of `HttpClient` (the default backend)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from yarl import URL

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


class AiohttpClient(HttpClient):
    """aiohttp-backed concrete client."""

    def __init__(self, config: HttpConfigBase | None = None) -> None:
        super().__init__(config)
        self._session: aiohttp.ClientSession | None = None
        # The session this client built and the loop it belongs to. A session assigned to
        # `_session` from outside (upstream's tests put a double there) is not in here.
        self._built: tuple[aiohttp.ClientSession, asyncio.AbstractEventLoop] | None = None

    def _timeout(self, timeout: float) -> aiohttp.ClientTimeout:
        # The override caps the whole request; sock_connect bounds the handshake on its own
        # so a stuck origin fails fast instead of burning the total budget.
        override = self._config.per_call_timeout_override
        return aiohttp.ClientTimeout(
            total=override if override is not None else timeout,
            sock_connect=self._config.connect_timeout,
        )

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._session
        # A session set on the client from outside is used as given. One built here belongs to
        # the loop that built it: reused from another loop (e.g. a second asyncio.run) it
        # is replaced below instead of failing deep in aiohttp.
        built_for_another_loop = (
            self._built is not None and self._built[0] is session and self._built[1] is not loop
        )
        if session is not None and not session.closed and not built_for_another_loop:
            return session
        connector = aiohttp.TCPConnector(
            limit=self._config.max_connections,
            # Fan-out to a single origin is the common case; a per-host cap would defeat it.
            limit_per_host=0,
            keepalive_timeout=self._config.keepalive_timeout,
            enable_cleanup_closed=True,
        )
        session = aiohttp.ClientSession(connector=connector, trust_env=True)
        self._session = session
        self._built = (session, loop)
        logger.debug(
            "aiohttp session created: limit=%d keepalive_timeout=%.1fs",
            self._config.max_connections,
            self._config.keepalive_timeout,
        )
        return session

    async def _fetch_simple(self, url: str, timeout_s: float) -> bytes:
        session = self._get_session()
        try:
            async with session.get(url, timeout=self._timeout(timeout_s)) as response:
                if response.status >= 400:
                    raise HttpStatusError(response.status, response.reason or "", url)
                return await response.read()
        except aiohttp.ClientResponseError as exc:
            # It carries the server's status (a session's `raise_for_status`, aiohttp's own
            # `TooManyRedirects`), so it is a status error, as upstream maps it.
            raise HttpStatusError(exc.status, exc.message, url) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise HttpTimeoutError(f"Timeout loading {describe_media_source(url)}") from exc
        except aiohttp.ClientError as exc:
            raise HttpConnectionError(
                f"Connection error loading {describe_media_source(url)}: {exc}"
            ) from exc

    async def _fetch_body_or_redirect(
        self, url: str, timeout_s: float
    ) -> tuple[bytes | None, str | None]:
        session = self._get_session()
        try:
            async with session.get(
                url, timeout=self._timeout(timeout_s), allow_redirects=False
            ) as response:
                if response.status in REDIRECT_STATUSES:
                    location = response.headers.get("Location")
                    if location:
                        return None, str(response.url.join(URL(location)))
                if response.status >= 400:
                    raise HttpStatusError(response.status, response.reason or "", url)
                return await response.read(), None
        except aiohttp.ClientResponseError as exc:
            # It carries the server's status (a session's `raise_for_status`, aiohttp's own
            # `TooManyRedirects`), so it is a status error, as upstream maps it.
            raise HttpStatusError(exc.status, exc.message, url) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise HttpTimeoutError(f"Timeout loading {describe_media_source(url)}") from exc
        except aiohttp.ClientError as exc:
            raise HttpConnectionError(
                f"Connection error loading {describe_media_source(url)}: {exc}"
            ) from exc

    async def close(self) -> None:
        """Close the session. Idempotent."""
        session, self._session = self._session, None
        self._built = None
        if session is not None and not session.closed:
            await session.close()
