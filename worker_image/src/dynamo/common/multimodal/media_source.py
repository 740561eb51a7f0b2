"""Where media bytes come from, shared by the image, audio and video loaders.

A multimodal item is a dict with exactly one of `"Url"`, `"Decoded"` (frontend-decoded media
sent over NIXL) or `"UuidOnly"` (image cache slot). `load_media_bytes` turns a URL into
bytes under a `UrlValidationPolicy`: http(s) through the SSRF-safe `fetch_bytes` (every
redirect hop re-validated), `data:` decoded inline, local files (`file:` or a bare path)
only inside the policy's `allowed_local_path`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import unquote, urlparse

from dynamo.common.http import HttpStatusError, fetch_bytes
from dynamo.common.http.url_validator import (
    UrlValidationError,
    UrlValidationPolicy,
    describe_media_source,
    parse_url,
    validate_media_url,
)

logger = logging.getLogger(__name__)

URL_VARIANT_KEY: Final = "Url"
DECODED_VARIANT_KEY: Final = "Decoded"
UUID_ONLY_VARIANT_KEY: Final = "UuidOnly"

T = TypeVar("T")


def env_int(name: str, default: int) -> int:
    """An integer environment setting; unset or empty gives `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def require_positive_timeout(http_timeout: float) -> float:
    """Validate a loader's `http_timeout`."""
    if not http_timeout > 0:
        raise ValueError(f"http_timeout must be positive, got {http_timeout}")
    return http_timeout


def refuse_frontend_decoding(kind: str) -> None:
    """Raise: frontend-decoded media needs a NIXL media connector this runtime lacks.

    Upstream reads frontend-decoded media through `dynamo.nixl_connect`; that connector is
    part of the Rust-backed frontend stack, which this pure-Python runtime does not ship, so
    the option is refused up front instead of failing on the first request.
    """
    raise RuntimeError(
        f"enable_frontend_decoding=True is not supported for {kind}: frontend-decoded media "
        "is read through dynamo.nixl_connect, which this runtime does not provide. Leave "
        "enable_frontend_decoding=False so media is loaded from its URL."
    )


def decode_data_url(url: str) -> tuple[str, bytes]:
    """Split a `data:<type>;base64,<payload>` URL into `(media type, decoded bytes)`."""
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise ValueError("Data URL has no ',' separating the header from the payload")
    params = header.split(";")
    if "base64" not in (param.strip().lower() for param in params[1:]):
        raise ValueError("Data URL must be base64 encoded")
    try:
        data = base64.b64decode(unquote(payload), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"Invalid base64 encoding: {exc}") from exc
    return params[0].strip().lower(), data


async def read_local_media(url: str, policy: UrlValidationPolicy) -> bytes:
    """Read a `file:` URL or bare path, only if it resolves inside `allowed_local_path`."""
    file_uri = await validate_media_url(url, policy)
    path = Path(unquote(urlparse(file_uri).path))
    return await asyncio.to_thread(path.read_bytes)


async def load_media_bytes(url: str, policy: UrlValidationPolicy, timeout_s: float) -> bytes:
    """The raw bytes behind `url` (http(s), `data:`, `file:` or a bare path) under `policy`."""
    if not url:
        raise UrlValidationError("URL is empty")
    scheme = parse_url(url).scheme.lower()
    if scheme in ("http", "https"):
        return await fetch_bytes(url, timeout_s, policy=policy)
    if scheme == "data":
        return decode_data_url(url)[1]
    if scheme in ("", "file"):
        return await read_local_media(url, policy)
    raise UrlValidationError(f"URL scheme '{describe_media_source(scheme)}' not allowed")


def item_source(item: Any) -> str:
    """A short label for a multimodal item in error messages."""
    if isinstance(item, dict) and isinstance(item.get(URL_VARIANT_KEY), str):
        return describe_media_source(item[URL_VARIANT_KEY], limit=80)
    return "decoded"


def gather_batch_results(kind: str, items: Sequence[Any], results: Sequence[Any]) -> list[Any]:
    """Turn `gather(..., return_exceptions=True)` results into values, or raise.

    The first `HttpStatusError` is re-raised (its status, e.g. 415, must reach the client),
    else the first `UrlValidationError` (a client error, not a 500), else one `Exception`
    listing every failure.
    """
    loaded: list[Any] = []
    failures: list[str] = []
    status_error: HttpStatusError | None = None
    url_error: UrlValidationError | None = None
    for item, result in zip(items, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancellation and the like are not per-item failures
            message = f"Failed to load {kind} from {item_source(item)}: {result}"
            logger.error("%s", message)
            failures.append(message)
            if status_error is None and isinstance(result, HttpStatusError):
                status_error = result
            elif url_error is None and isinstance(result, UrlValidationError):
                url_error = result
            continue
        loaded.append(result)
    if status_error is not None:
        raise status_error
    if url_error is not None:
        raise url_error
    if failures:
        raise Exception("\n".join(failures))
    return loaded


def require_url_item(kind: str, index: int, item: Any) -> str:
    """The URL of a `{"Url": ...}` item; a clear error for anything else."""
    if not isinstance(item, dict):
        raise ValueError(
            f"Invalid {kind} multimodal item at index {index}: expected a dict with a "
            f"'{URL_VARIANT_KEY}' or '{DECODED_VARIANT_KEY}' key, got {type(item).__name__}"
        )
    if DECODED_VARIANT_KEY in item:
        raise ValueError(
            f"Received decoded {kind} data but enable_frontend_decoding=False. "
            f"Enable frontend decoding to transfer decoded {kind} via NIXL."
        )
    url = item.get(URL_VARIANT_KEY)
    if not isinstance(url, str):
        raise ValueError(
            f"Invalid {kind} multimodal item at index {index}: expected a dict with a "
            f"'{URL_VARIANT_KEY}' (string) or '{DECODED_VARIANT_KEY}' key, got keys {sorted(item)}"
        )
    return url
