"""Every request `huggingface_hub` sends for an adapter download passes the media URL policy.

The Hub answers downloads with redirects (to its CDN, to LFS storage); a Hub, a mirror or a
proxy that redirects to `http://169.254.169.254/` or to a service inside the cluster would
otherwise have the worker fetch it and store the answer as an adapter file. A request hook on
the Hub's shared HTTP client checks each hop before it is sent (httpx runs request hooks for
every redirect): requests to the configured `HF_ENDPOINT` itself pass (the operator's user
chose it, and a test or air-gapped Hub lives on a private address), any other URL must pass
`UrlValidationPolicy.from_env()` (https only, no private, loopback or link-local address,
checked after resolving the name; `DYN_MM_ALLOW_INTERNAL=1` loosens it as it does for media).
A refused hop fails the download with reason "unsafe source" before anything is fetched.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from dynamo.common.http.url_validator import (
    UrlValidationError,
    UrlValidationPolicy,
    describe_media_source,
    validate_url,
)
from dynamo.common.lora.errors import REASON_UNSAFE, LoRADownloadError

_installed = threading.Lock()
_done = False


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def check_hop(url: str, endpoint: str, policy: UrlValidationPolicy) -> None:
    """Raise LoRADownloadError(REASON_UNSAFE) unless `url` is on `endpoint` or passes
    `policy` (resolving its host). Runs in the download's worker thread."""
    if _origin(url) == _origin(endpoint):
        return
    try:
        asyncio.run(validate_url(url, policy))
    except UrlValidationError as exc:
        raise LoRADownloadError(
            f"refusing a Hub request to {describe_media_source(url)!r} (off {endpoint}): {exc}",
            REASON_UNSAFE,
        ) from exc


def request_hook(endpoint: Callable[[], str]) -> Callable[[Any], None]:
    """An httpx request hook checking each request against `endpoint()` (read per request,
    so a changed `HF_ENDPOINT` applies) and the media policy from the environment."""

    def hook(request: Any) -> None:
        check_hop(str(request.url), endpoint(), UrlValidationPolicy.from_env())

    return hook


def install(endpoint: Callable[[], str]) -> None:
    """Add the check to the Hub client (once per process; the Hub shares one client)."""
    global _done
    with _installed:
        if _done:
            return
        from huggingface_hub.utils import _http

        def factory() -> Any:
            client = _http.default_client_factory()
            client.event_hooks["request"].append(request_hook(endpoint))
            return client

        _http.set_client_factory(factory)
        _done = True
