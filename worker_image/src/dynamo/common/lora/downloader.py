"""`LoRADownloader`: the Python port of upstream's Rust downloader, made safe.

Upstream's Python surface is kept: `LoRADownloader(cache_path=None)`,
`await download_if_needed(uri)`, `get_cache_path(key)`, `is_cached(uri)`,
`validate_cached(key)` and `uri_to_cache_key(uri)`. What differs, on purpose:

* one download per URI at a time across threads and processes (a file lock per cache key);
* downloads land in a temp dir beside the cache entry and are renamed into place only after
  they validate and carry the completion marker, so an interrupted download never counts as
  cached (`validate_cached` requires the marker);
* file names from a listing that would land outside the destination, escaping symlinks in a
  `file://` source, and listings with more than `max_adapter_files()` files are refused;
* an optional expected `adapter_digest` (sha256) is checked before an adapter is published
  or returned;
* S3 credentials are read when a download starts, not when the downloader is built;
* every failure is a `LoRADownloadError` (a `RuntimeError`, message prefixed
  "Download failed: " as upstream) whose `reason` says what went wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import time
from pathlib import Path

from dynamo.common.lora import hf_source, s3_source
from dynamo.common.lora._env import download_timeout
from dynamo.common.lora.adapter import (
    COMPLETE_MARKER,
    COMPLETE_MARKER_BYTES,
    DIGEST_RECORD,
    adapter_digest,
    atomic_write,
    describe_invalid,
    is_complete,
    validate_path,
)
from dynamo.common.lora.cache import checked_cache_key, default_cache_root, uri_to_cache_key
from dynamo.common.lora.errors import (
    REASON_BAD_DIGEST,
    REASON_BAD_URI,
    REASON_DIGEST_MISMATCH,
    REASON_FAILED,
    REASON_INVALID_ADAPTER,
    LoRADownloadError,
    cache_full_error,
    is_disk_full,
)
from dynamo.common.lora.local_source import SCHEME_PREFIX as FILE_PREFIX
from dynamo.common.lora.local_source import resolve_local
from dynamo.common.lora.locking import hold_key_lock, run_in_thread

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")


class LoRADownloader:
    """Fetches LoRA adapters from `file://`, `s3://` and `hf://` URIs into a local cache."""

    def __init__(self, cache_path: str | None = None) -> None:
        """`cache_path`, else `DYN_LORA_PATH`, else `~/.cache/dynamo_loras` (created lazily)."""
        self._root = Path(cache_path) if cache_path else default_cache_root()

    @property
    def cache_root(self) -> Path:
        """The directory holding cached adapters, lock files and in-flight downloads."""
        return self._root

    @staticmethod
    def uri_to_cache_key(uri: str) -> str:
        """The cache directory name for `uri` (see `cache.uri_to_cache_key`)."""
        return uri_to_cache_key(uri)

    def get_cache_path(self, key: str) -> str:
        """`<cache root>/<key>`."""
        return str(self._root / key)

    def validate_cached(self, key: str) -> bool:
        """True when `<cache root>/<key>` is a finished, valid adapter download."""
        return is_complete(self._root / key)

    def is_cached(self, uri: str) -> bool:
        """True when `uri` is cached: `hf://` in the hub cache, others under the cache root.

        Raises `LoRADownloadError("Cache lookup failed: ...")` for an unparseable `hf://` URI.
        """
        if uri.startswith(hf_source.SCHEME_PREFIX):
            try:
                location = hf_source.parse_hf_uri(uri)
            except LoRADownloadError as exc:
                raise LoRADownloadError(f"Cache lookup failed: {exc}", exc.reason) from exc
            return hf_source.cached_snapshot(location) is not None
        return self.validate_cached(uri_to_cache_key(uri))

    async def download_if_needed(self, uri: str, *, sha256: str | None = None) -> str:
        """Return a local directory holding the adapter at `uri`, downloading it if needed.

        `file://` returns the directory itself; `s3://` returns `<cache root>/<key>`;
        `hf://` returns the hub-cache snapshot. With `sha256` (64 hex digits, see
        `adapter.adapter_digest`) the adapter's digest must match, else the reason is
        `"digest mismatch"` and nothing mismatching is published.
        """
        try:
            return str(await self._download(uri, normalize_digest(sha256)))
        except LoRADownloadError as exc:
            raise LoRADownloadError(f"Download failed: {exc}", exc.reason) from exc
        except (OSError, ValueError) as exc:
            if is_disk_full(exc):  # sealing or publishing a download filled the cache
                full = cache_full_error(exc, uri)
                raise LoRADownloadError(f"Download failed: {full}", full.reason) from exc
            raise LoRADownloadError(f"Download failed: {exc}", REASON_FAILED) from exc

    async def _download(self, uri: str, expected: str | None) -> Path:
        if "://" not in uri:
            raise LoRADownloadError(
                f"LoRA URI {uri!r} has no scheme; use file://, s3:// or hf://", REASON_BAD_URI
            )
        if uri.startswith(FILE_PREFIX):
            path = resolve_local(uri)
            await check_digest(path, expected, uri, record=False)
            return path
        if uri.startswith(s3_source.SCHEME_PREFIX):
            return await self._download_s3(uri, expected)
        if uri.startswith(hf_source.SCHEME_PREFIX):
            return await self._download_hf(uri, expected)
        scheme = uri.split("://")[0]
        raise LoRADownloadError(
            f"unsupported LoRA URI scheme {scheme!r} in {uri!r}; use file://, s3:// or hf://, "
            "or register a custom source for it",
            REASON_BAD_URI,
        )

    async def _cached(self, path: Path, expected: str | None, uri: str) -> bool:
        if not is_complete(path):
            return False
        try:
            await check_digest(path, expected, uri, record=True)
        except LoRADownloadError as exc:
            # The source may hold a newer adapter under the same URI: fetch it again.
            logger.warning("cached LoRA at %s does not match: %s; fetching it again", path, exc)
            return False
        return True

    def lock_path(self, key: str) -> Path:
        """The lock file serialising downloads of `key`."""
        return self._root / f"{key}.lock"

    async def _download_s3(self, uri: str, expected: str | None) -> Path:
        s3_source.parse_s3_uri(uri)  # refuse a bad URI before touching the cache
        key = checked_cache_key(uri)
        dest = self._root / key
        if await self._cached(dest, expected, uri):
            return dest
        async with hold_key_lock(self.lock_path(key), download_timeout(), uri):
            # Another thread or process may have finished while this one waited.
            if await self._cached(dest, expected, uri):
                return dest
            self._remove_leftovers(key)
            temp = self._root / f"{key}.tmp.{os.getpid()}.{time.time_ns()}"
            temp.mkdir(parents=True)
            try:
                await s3_source.download_s3(uri, temp)
                await _seal(temp, expected, uri)
                _publish(temp, dest)
            except BaseException:
                shutil.rmtree(temp, ignore_errors=True)
                raise
        logger.info("downloaded LoRA %s to %s", uri, dest)
        return dest

    async def _download_hf(self, uri: str, expected: str | None) -> Path:
        location = hf_source.parse_hf_uri(uri)
        snapshot = hf_source.cached_snapshot(location)
        if snapshot is not None and await self._cached(snapshot, expected, uri):
            return snapshot
        if hf_source.offline():
            if snapshot is not None:
                await check_digest(snapshot, expected, uri, record=True)
            raise hf_source.offline_error(uri)
        key = checked_cache_key(uri)
        async with hold_key_lock(self.lock_path(key), download_timeout(), uri):
            snapshot = hf_source.cached_snapshot(location)
            if snapshot is not None and await self._cached(snapshot, expected, uri):
                return snapshot
            fetched, commit = await run_in_thread(
                lambda cancel: hf_source.fetch_snapshot(uri, location, cancel)
            )
            await check_digest(fetched, expected, uri, record=True)
            hf_source.mark_complete(location, fetched, commit)
        logger.info("downloaded LoRA %s to %s", uri, fetched)
        return fetched

    def _remove_leftovers(self, key: str) -> None:
        # Called with the key's lock held: temp and old dirs of this key belong to downloads
        # that died (a live one would hold the lock).
        if not self._root.is_dir():
            return
        for entry in self._root.iterdir():
            if entry.name.startswith((f"{key}.tmp.", f"{key}.old.")):
                shutil.rmtree(entry, ignore_errors=True)


def normalize_digest(sha256: str | None) -> str | None:
    """Lower-case 64-hex form of an expected digest (a `sha256:` prefix is accepted)."""
    if sha256 is None:
        return None
    digest = sha256.strip().lower()
    digest = digest.removeprefix("sha256:")
    if not _SHA256.fullmatch(digest):
        raise LoRADownloadError(
            f"sha256 {sha256!r} is not 64 hexadecimal digits; pass the adapter_digest of the "
            "adapter directory",
            REASON_BAD_DIGEST,
        )
    return digest


async def check_digest(path: Path, expected: str | None, uri: str, *, record: bool) -> None:
    """Raise `"digest mismatch"` when `path`'s `adapter_digest` is not `expected`.

    With `record`, a digest stored in the download's `.dynamo_lora_sha256` is trusted (the
    files of a finished download are not rewritten), and a computed one is stored there.
    """
    if expected is None:
        return
    stored = path / DIGEST_RECORD
    actual = ""
    if record:
        with contextlib.suppress(OSError):
            actual = stored.read_text().strip()
    if not actual:
        actual = await asyncio.to_thread(adapter_digest, path)
        if record:
            with contextlib.suppress(OSError):
                atomic_write(stored, actual.encode())
    if actual != expected:
        raise LoRADownloadError(
            f"digest mismatch for {uri}: expected sha256 {expected}, the adapter has {actual}",
            REASON_DIGEST_MISMATCH,
        )


async def _seal(temp: Path, expected: str | None, uri: str) -> None:
    """Check a finished download in `temp` and write its completion marker last."""
    if not validate_path(temp):
        raise LoRADownloadError(
            f"{uri} is not a valid LoRA adapter: {describe_invalid(temp)}",
            REASON_INVALID_ADAPTER,
        )
    await check_digest(temp, expected, uri, record=True)
    (temp / COMPLETE_MARKER).write_bytes(COMPLETE_MARKER_BYTES)


def _publish(temp: Path, dest: Path) -> None:
    """Move a sealed download into place; an older entry is renamed away first, so `dest`
    is never a half-written directory."""
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f"{dest.name}.old.{time.time_ns()}")
        os.rename(dest, old)
        os.rename(temp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(temp, dest)
