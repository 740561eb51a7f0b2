"""The backend-neutral HTTP client contract and the unified error classes.

Callers only ever see these error classes, never aiohttp's or httpx's own. The SSRF-safe
redirect loop lives here, once, so both backends follow exactly the same rules.
"""

from __future__ import annotations

import abc
from typing import Final

from .config import HttpConfigBase, from_env
from .url_validator import (
    MAX_REDIRECTS,
    UrlValidationError,
    UrlValidationPolicy,
    describe_media_source,
    validate_url,
)

#: Statuses that are followed as redirects when they carry a `Location` header.
REDIRECT_STATUSES: Final = frozenset({301, 302, 303, 307, 308})


class HttpError(Exception):
    """Base class for all HTTP fetch failures."""


class HttpTimeoutError(HttpError):
    """Timeout during connect / read / pool-wait."""


class HttpConnectionError(HttpError):
    """Network-layer failure: DNS, refused, reset, half-close."""


class HttpStatusError(HttpError):
    """Server responded with a non-2xx status."""

    def __init__(self, status: int, message: str, url: str) -> None:
        # The URL is client-supplied (possibly a huge data: URL), so the rendered text
        # carries a bounded label; `.url` keeps the full value for debugging.
        super().__init__(f"HTTP {status} for {describe_media_source(url)}: {message}")
        self.status = status
        self.message = message
        self.url = url


class HttpClient(abc.ABC):
    """Backend-neutral HTTP client.

    Subclasses own a backend-specific session/client on the instance. Callers use
    `fetch_bytes` and the unified exception classes; the backend type is invisible past
    instantiation.
    """

    def __init__(self, config: HttpConfigBase | None = None) -> None:
        self._config: HttpConfigBase = config if config is not None else from_env()

    @property
    def config(self) -> HttpConfigBase:
        """The settings this client was built with."""
        return self._config

    async def fetch_bytes(
        self,
        url: str,
        timeout: float,  # noqa: ASYNC109 - the documented API takes a per-call timeout
        *,
        policy: UrlValidationPolicy | None = None,
    ) -> bytes:
        """Fetch `url` and return the response body.

        Single-shot: no retries. Raises `HttpStatusError`, `HttpTimeoutError` or
        `HttpConnectionError`, never a backend's native exception.

        `policy=None`: the backend's built-in redirect handling.
        `policy` set: redirects are followed by hand and every hop, the first included, is
        checked with `validate_url`; a refused hop or more than `MAX_REDIRECTS` (3) redirects
        raises `UrlValidationError`. This is the SSRF-safe path.
        """
        if policy is None:
            return await self._fetch_simple(url, timeout)
        return await self._fetch_with_revalidation(url, timeout, policy)

    async def _fetch_with_revalidation(
        self, url: str, timeout_s: float, policy: UrlValidationPolicy
    ) -> bytes:
        current = url
        visited: list[str] = []
        while True:
            await validate_url(current, policy)
            visited.append(current)
            body, redirect_to = await self._fetch_body_or_redirect(current, timeout_s)
            if redirect_to is None:
                if body is None:
                    raise HttpError(
                        f"Backend returned neither a body nor a redirect for "
                        f"{describe_media_source(current)}"
                    )
                return body
            if len(visited) > MAX_REDIRECTS:
                chain = [describe_media_source(hop) for hop in visited]
                raise UrlValidationError(f"Too many redirects (max={MAX_REDIRECTS}); chain={chain}")
            current = redirect_to

    @abc.abstractmethod
    async def _fetch_simple(self, url: str, timeout_s: float) -> bytes:
        """GET with the backend's own redirect following (no SSRF policy)."""

    @abc.abstractmethod
    async def _fetch_body_or_redirect(
        self, url: str, timeout_s: float
    ) -> tuple[bytes | None, str | None]:
        """One GET with redirects disabled.

        Returns `(body, None)` for a terminal response (2xx, or 3xx without `Location`),
        `(None, absolute_next_url)` for a redirect; raises `HttpStatusError` for 4xx/5xx and
        the timeout / connection classes on transport failure.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the backend session/client. Idempotent."""
