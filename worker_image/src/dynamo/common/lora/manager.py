"""`LoRAManager`: the engine-facing entry point for fetching LoRA adapters."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dynamo.common.lora._env import download_timeout
from dynamo.common.lora.cache import checked_cache_key, uri_to_cache_key
from dynamo.common.lora.downloader import LoRADownloader, check_digest, normalize_digest
from dynamo.common.lora.errors import REASON_FAILED, REASON_NOT_FOUND, LoRADownloadError
from dynamo.common.lora.locking import hold_key_lock
from dynamo.common.lora.once import OnceLock
from dynamo.common.utils.env import env_bool

logger = logging.getLogger(__name__)


class LoRASourceProtocol(Protocol):
    """Protocol for custom Python LoRA sources. Users can implement this to add custom sources."""

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        """Download LoRA to dest_path, return actual path"""
        ...

    async def exists(self, lora_uri: str) -> bool:
        """Check if LoRA exists in this source"""
        ...


@dataclass(frozen=True)
class LoRAInfo:
    """Metadata for a loaded LoRA adapter."""

    id: int
    path: str


class LoRAManager:
    """Minimal Python wrapper around the downloader with extension points.

    The manager uses `LoRADownloader` for local, S3, and Hugging Face sources, and allows
    registering custom Python sources for other protocols.
    """

    def __init__(self, cache_path: Path | None = None) -> None:
        """Initialize LoRA manager.

        Args:
            cache_path: Optional custom cache path. If not provided, uses DYN_LORA_PATH env var.
        """
        self._downloader = LoRADownloader(str(cache_path) if cache_path else None)
        self._custom_sources: dict[str, LoRASourceProtocol] = {}

    @property
    def downloader(self) -> LoRADownloader:
        """The downloader serving `file://`, `s3://` and `hf://` URIs."""
        return self._downloader

    def register_custom_source(self, scheme: str, source: LoRASourceProtocol) -> None:
        """Register a custom Python source for a URI scheme.

        Args:
            scheme: URI scheme without "://" (e.g., "hf" for hf:// URIs). A custom source
                takes precedence over the built-in one for its scheme.
            source: LoRA source implementing LoRASourceProtocol
        """
        self._custom_sources[scheme] = source

    async def download_lora(self, lora_uri: str) -> dict[str, Any]:
        """Download LoRA if needed, return local path.

        The source is inferred from the URI scheme: `file://` (used in place), `s3://`,
        `hf://`, or a scheme registered with `register_custom_source`.

        Args:
            lora_uri: Source URI (file://, s3://, hf://, or custom scheme)

        Returns:
            `{"status": "success", "local_path": str}`, or
            `{"status": "error", "message": str, "reason": str}` where `reason` is one of
            the `dynamo.common.lora.errors.REASON_*` values ("not found", "bad uri", "auth",
            "timeout", "invalid adapter", "unsafe source", "offline", "download failed").
            Cancellation propagates.
        """
        return await self._download(lora_uri, None)

    async def download_lora_verified(self, lora_uri: str, sha256: str) -> dict[str, Any]:
        """`download_lora`, and the adapter's `adapter_digest` must equal `sha256`.

        `sha256` is 64 hex digits (an optional `sha256:` prefix is accepted). A malformed
        value gives reason "bad digest"; a different adapter gives reason "digest mismatch",
        and a mismatching download is never published to the cache.
        """
        return await self._download(lora_uri, sha256)

    async def _download(self, lora_uri: str, sha256: str | None) -> dict[str, Any]:
        try:
            scheme = lora_uri.split("://")[0] if "://" in lora_uri else None
            source = self._custom_sources.get(scheme) if scheme is not None else None
            if source is not None:
                local = str(await self._download_custom(source, lora_uri, sha256))
            else:
                local = await self._downloader.download_if_needed(lora_uri, sha256=sha256)
            return {"status": "success", "local_path": local}
        except LoRADownloadError as exc:
            return {"status": "error", "message": str(exc), "reason": exc.reason}
        except Exception as exc:
            return {"status": "error", "message": str(exc), "reason": REASON_FAILED}

    async def _download_custom(
        self, source: LoRASourceProtocol, lora_uri: str, sha256: str | None
    ) -> Path:
        expected = normalize_digest(sha256)
        key = checked_cache_key(lora_uri)
        # Custom sources get the same one-download-per-URI guarantee as the built-in ones.
        async with hold_key_lock(self._downloader.lock_path(key), download_timeout(), lora_uri):
            if not await source.exists(lora_uri):
                raise LoRADownloadError(f"LoRA not found at {lora_uri}", REASON_NOT_FOUND)
            dest = Path(self._downloader.get_cache_path(key))
            local = await source.download(lora_uri, dest)
        await check_digest(Path(local), expected, lora_uri, record=False)
        return Path(local)

    def is_cached(self, lora_uri: str) -> bool:
        """Check if LoRA is already cached locally."""
        return self._downloader.is_cached(lora_uri)

    @staticmethod
    def _uri_to_cache_key(uri: str) -> str:
        return uri_to_cache_key(uri)


_lora_manager: OnceLock[LoRAManager] = OnceLock()


def _create_manager() -> LoRAManager:
    manager = LoRAManager()
    logger.info("LoRAManager initialized successfully")
    return manager


def get_lora_manager() -> LoRAManager | None:
    """Return the LoRAManager singleton, or None when DYN_LORA_ENABLED is unset.

    Initializes on first call. Initialization errors propagate to the caller —
    OnceLock does not cache failures, so subsequent calls will retry. Once created, the
    manager is returned even if DYN_LORA_ENABLED changes later. The flag is true for
    `true`, `1` or `yes` in any case (not `on`).
    """
    existing = _lora_manager.get()
    if existing is not None:
        return existing
    if not env_bool("DYN_LORA_ENABLED"):
        return None
    return _lora_manager.get_or_init(_create_manager)
