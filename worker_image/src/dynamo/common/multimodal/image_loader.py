"""Image loading for multimodal requests: http(s) and `data:` URLs, decoded with Pillow.

Local files are refused whatever the policy says. Remote images are fetched through the
SSRF-safe client (the policy re-checks every redirect hop), kept in a small LRU cache, and
concurrent requests for the same URL share one download. JPEG, PNG and WEBP are accepted
and returned as RGB `PIL.Image.Image`s; anything else is `HttpStatusError(415)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from io import BytesIO
from typing import Any, ClassVar, Final
from urllib.parse import urlsplit, urlunsplit

from PIL import Image, UnidentifiedImageError

from dynamo.common.http import HttpStatusError, HttpTimeoutError, fetch_bytes
from dynamo.common.http.url_validator import (
    UrlValidationError,
    UrlValidationPolicy,
    describe_media_source,
    parse_url,
)

from .media_source import (
    DECODED_VARIANT_KEY,
    URL_VARIANT_KEY,
    UUID_ONLY_VARIANT_KEY,
    decode_data_url,
    env_int,
    gather_batch_results,
    refuse_frontend_decoding,
    require_positive_timeout,
)

logger = logging.getLogger(__name__)

SUPPORTED_FORMATS: Final = ("JPEG", "PNG", "WEBP")


class _UnsupportedImageFormat(ValueError):
    """Decodable bytes that are not one of SUPPORTED_FORMATS (reported as HTTP 415)."""


def _decode_image(data: bytes) -> Image.Image:
    """Identify, check and fully decode an image to RGB. Runs in a worker thread."""
    try:
        image = Image.open(BytesIO(data))
    except UnidentifiedImageError as exc:
        raise _UnsupportedImageFormat("Unsupported image format: not a recognised image") from exc
    if image.format not in SUPPORTED_FORMATS:
        raise _UnsupportedImageFormat(f"Unsupported image format: {image.format}")
    # Image.open is lazy; convert() forces the pixel decode here, off the event loop.
    return image.convert("RGB")


def _cache_key(url: str) -> str:
    """Cache key for an http(s) URL: scheme and host lower-cased, the rest kept as is.

    Upstream lower-cases the whole URL, which makes `/a.png` and `/A.png` (different
    resources on any case-sensitive server, and different presigned signatures) share one
    cache entry; only the scheme and host are case-insensitive, so only they are folded.
    """
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=parts.scheme.lower(), netloc=parts.netloc.lower()))


class ImageLoader:
    """Loads images for multimodal requests (see the module docstring)."""

    CACHE_SIZE_MAXIMUM: ClassVar[int] = env_int("DYN_MM_IMAGE_CACHE_SIZE", 8)

    def __init__(
        self,
        cache_size: int = CACHE_SIZE_MAXIMUM,
        http_timeout: float = 30.0,
        enable_frontend_decoding: bool = False,
        url_policy: UrlValidationPolicy | None = None,
    ) -> None:
        """Initialize the ImageLoader with caching, HTTP settings and the URL policy.

        `cache_size`: most images kept in the in-memory LRU cache (default
        `DYN_MM_IMAGE_CACHE_SIZE`, else 8; 0 disables caching).
        `http_timeout`: seconds allowed for fetching one remote image.
        `enable_frontend_decoding`: read frontend-decoded images over NIXL; not available
        in this runtime, so True raises `RuntimeError`.
        `url_policy`: SSRF policy for URLs; defaults to `UrlValidationPolicy.from_env()`.
        """
        if cache_size < 0:
            raise ValueError(f"cache_size must be 0 or more, got {cache_size}")
        if enable_frontend_decoding:
            refuse_frontend_decoding("images")
        self._cache_size = cache_size
        self._http_timeout = require_positive_timeout(http_timeout)
        self._enable_frontend_decoding = enable_frontend_decoding
        self._url_policy = url_policy if url_policy is not None else UrlValidationPolicy.from_env()
        self._image_cache: OrderedDict[str, Image.Image] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[Image.Image]] = {}

    async def load_image(self, image_url: str) -> Image.Image:
        """Load one image from an http(s) or `data:image/...;base64,` URL, as RGB.

        Raises `ValueError` for local paths, other schemes, malformed data URLs, timeouts
        and undecodable images; `UrlValidationError` when the policy refuses the URL (or a
        redirect hop); `HttpStatusError` for HTTP errors and 415 for unsupported formats.
        """
        scheme = parse_url(image_url).scheme.lower()
        if scheme in ("", "file"):
            raise ValueError("Invalid image source scheme: local file access is not allowed")
        if scheme in ("http", "https"):
            return await self._load_remote(image_url)
        if scheme == "data":
            return await self._load_data_url(image_url)
        raise ValueError(f"Invalid image source scheme: {scheme}")

    async def _load_remote(self, image_url: str) -> Image.Image:
        key = _cache_key(image_url)
        cached = self._image_cache.get(key)
        if cached is not None:
            self._image_cache.move_to_end(key)
            return cached
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch_and_cache(key, image_url))
            # Keeps asyncio quiet about an unretrieved exception if every waiter is cancelled.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._inflight[key] = task
        # Shielded: cancelling one caller must not cancel the download the others share.
        return await asyncio.shield(task)

    async def _fetch_and_cache(self, key: str, image_url: str) -> Image.Image:
        try:
            image = await self._fetch_and_decode(image_url)
            if self._cache_size > 0:
                if len(self._image_cache) >= self._cache_size:
                    self._image_cache.popitem(last=False)
                self._image_cache[key] = image
            return image
        finally:
            self._inflight.pop(key, None)

    async def _fetch_and_decode(self, image_url: str) -> Image.Image:
        label = describe_media_source(image_url)
        try:
            data = await fetch_bytes(image_url, self._http_timeout, policy=self._url_policy)
            if not data:
                raise ValueError("Empty response content from image URL")
            return await asyncio.to_thread(_decode_image, data)
        except _UnsupportedImageFormat as exc:
            logger.error("Unsupported image format loading '%s': %s", label, exc)
            raise HttpStatusError(415, "Unsupported Media Type", image_url) from exc
        except (HttpStatusError, UrlValidationError):
            raise
        except HttpTimeoutError as exc:
            logger.error("Timeout loading image '%s' (timeout=%ss)", label, self._http_timeout)
            raise ValueError(f"Timeout loading image: '{label}'") from exc
        except Exception as exc:
            logger.error("%s loading image '%s': %s", type(exc).__name__, label, exc)
            raise ValueError(f"Failed to load image: '{label}': {exc}") from exc

    async def _load_data_url(self, image_url: str) -> Image.Image:
        label = describe_media_source(image_url)
        try:
            media_type, data = decode_data_url(image_url)
            if not media_type.startswith("image/"):
                raise ValueError("Data URL must be an image type")
            return await asyncio.to_thread(_decode_image, data)
        except _UnsupportedImageFormat as exc:
            raise HttpStatusError(415, "Unsupported Media Type", image_url) from exc
        except Exception as exc:
            logger.error("%s decoding image '%s': %s", type(exc).__name__, label, exc)
            raise ValueError(f"Failed to decode image: '{label}': {exc}") from exc

    async def load_image_batch(
        self, image_mm_items: list[dict[str, Any]], *, preserve_uuid_slots: bool = False
    ) -> list[Any]:
        """Load a batch of images from multimodal data items, concurrently.

        `{"Url": url}` items are loaded with `load_image`. `{"UuidOnly": ...}` items keep an
        aligned `None` slot (for a backend cache lookup) when `preserve_uuid_slots` is True
        and are a `ValueError` otherwise; `{"Decoded": ...}` items need frontend decoding,
        which is off, so they are a `ValueError` too.

        Raises the first `HttpStatusError` (e.g. 415), else the first `UrlValidationError`,
        else one `Exception` naming every image that failed.
        """
        # Every item is checked before any load starts, so a bad item fails the batch
        # without leaving downloads behind.
        urls: list[str | None] = []
        for index, item in enumerate(image_mm_items):
            if not isinstance(item, dict):
                raise ValueError(
                    f"Invalid image multimodal item at index {index}: expected a dict, "
                    f"got {type(item).__name__}"
                )
            if isinstance(item.get(URL_VARIANT_KEY), str):
                urls.append(item[URL_VARIANT_KEY])
            elif DECODED_VARIANT_KEY in item:
                logger.error(
                    "Received Decoded multimodal data but enable_frontend_decoding=False. "
                    "Set enable_frontend_decoding=True to enable NIXL RDMA image transfer."
                )
                raise ValueError("Could not load decoded media from frontend")
            elif UUID_ONLY_VARIANT_KEY in item:
                if not preserve_uuid_slots:
                    raise ValueError(
                        f"Image item at index {index} is UUID-only, but this backend does not "
                        "resolve UUID-only slots (preserve_uuid_slots=False); send the image URL"
                    )
                urls.append(None)
            else:
                raise ValueError(
                    f"Invalid image multimodal item at index {index}: expected one of "
                    f"'{URL_VARIANT_KEY}', '{DECODED_VARIANT_KEY}', '{UUID_ONLY_VARIANT_KEY}', "
                    f"got keys {sorted(item)}"
                )
        loads = [self.load_image(url) for url in urls if url is not None]
        results = await asyncio.gather(*loads, return_exceptions=True)
        url_items = [
            item for item, url in zip(image_mm_items, urls, strict=True) if url is not None
        ]
        images = iter(gather_batch_results("image", url_items, results))
        return [None if url is None else next(images) for url in urls]
