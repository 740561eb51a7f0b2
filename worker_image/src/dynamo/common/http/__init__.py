"""Dynamo's outbound HTTP fetch client.

`fetch_bytes` runs over a process-wide client chosen by `DYN_HTTP_BACKEND`: `aiohttp`
(default) or `httpx`, case-insensitive; any other value is a `ValueError`. Callers catch the
unified error classes (`HttpStatusError`, `HttpTimeoutError`, `HttpConnectionError`, all
`HttpError`). Pass a `UrlValidationPolicy` for SSRF-safe fetching of user-supplied URLs:
every redirect hop is then re-validated and at most 3 redirects are followed.
"""

from __future__ import annotations

import logging
import os

from .aiohttp_client import AiohttpClient
from .base import HttpClient, HttpConnectionError, HttpError, HttpStatusError, HttpTimeoutError
from .config import HttpConfigBase, add_http_args, apply_legacy_env_aliases, from_env
from .httpx_client import HttpxClient
from .url_validator import (
    UrlValidationError,
    UrlValidationPolicy,
    validate_local_path,
    validate_media_url,
    validate_url,
)

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, type[HttpClient]] = {"aiohttp": AiohttpClient, "httpx": HttpxClient}

_default: HttpClient | None = None


def _create_client() -> HttpClient:
    apply_legacy_env_aliases()
    name = os.environ.get("DYN_HTTP_BACKEND", "").strip().lower() or "aiohttp"
    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(
            f"DYN_HTTP_BACKEND={os.environ['DYN_HTTP_BACKEND']!r} is not supported; "
            f"use one of: {', '.join(sorted(_BACKENDS))}"
        )
    return backend()


def get_default_client() -> HttpClient:
    """Return the process-wide singleton client, instantiating on first call."""
    global _default
    if _default is None:
        _default = _create_client()
        logger.info("HTTP backend resolved: %s", type(_default).__name__)
    return _default


async def fetch_bytes(
    url: str,
    timeout: float,  # noqa: ASYNC109 - the documented API takes a per-call timeout
    *,
    policy: UrlValidationPolicy | None = None,
) -> bytes:
    """Singleton-backed convenience wrapper over `HttpClient.fetch_bytes`."""
    return await get_default_client().fetch_bytes(url, timeout, policy=policy)


async def close_http_client() -> None:
    """Close the active singleton. Idempotent. Safe across resets.

    Clears the resolved client so the next call reads the environment again (useful in
    tests that vary `DYN_HTTP_BACKEND`).
    """
    global _default
    client, _default = _default, None
    if client is not None:
        await client.close()


__all__ = [
    "AiohttpClient",
    "HttpClient",
    "HttpConfigBase",
    "HttpConnectionError",
    "HttpError",
    "HttpStatusError",
    "HttpTimeoutError",
    "HttpxClient",
    "UrlValidationError",
    "UrlValidationPolicy",
    "add_http_args",
    "close_http_client",
    "fetch_bytes",
    "from_env",
    "get_default_client",
    "validate_local_path",
    "validate_media_url",
    "validate_url",
]
