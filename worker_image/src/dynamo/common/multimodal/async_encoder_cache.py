"""Async wrapper over `MultimodalEmbeddingCacheManager` with request coalescing.

Concurrent requests for the same content run the encoder once:

    cache = AsyncEncoderCache(MultimodalEmbeddingCacheManager(capacity_bytes=4 * 1024**3))
    entry = await cache.get_or_compute(content_hash, encode)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dynamo.common.memory import CachedEmbedding, MultimodalEmbeddingCacheManager

logger = logging.getLogger(__name__)


def _retrieve_exception(task: asyncio.Task[CachedEmbedding]) -> None:
    # Marks a failed computation's exception as retrieved even if every waiter was
    # cancelled, so asyncio does not log "Task exception was never retrieved".
    if not task.cancelled():
        task.exception()


class AsyncEncoderCache:
    """Async wrapper with request coalescing over MultimodalEmbeddingCacheManager.

    Provides async get_or_compute that deduplicates concurrent requests for the same key,
    ensuring only one encoding runs at a time per key.

    Thread Safety:
        This class is NOT thread-safe. It is designed to run within a single asyncio event
        loop. All access must be from the same thread.
    """

    def __init__(self, cache: MultimodalEmbeddingCacheManager) -> None:
        """Initialize the async encoder cache over `cache`, which stores the results."""
        self._cache = cache
        self._in_flight: dict[str, asyncio.Task[CachedEmbedding]] = {}

    def get(self, key: str) -> CachedEmbedding | None:
        """Synchronous get from the underlying cache; None if not found."""
        return self._cache.get(key)

    async def get_or_compute(
        self, key: str, compute_fn: Callable[[], Awaitable[CachedEmbedding]]
    ) -> CachedEmbedding:
        """Get from cache or compute with request coalescing.

        A cached key returns at once. If another coroutine is already computing the key,
        this one waits for that result. Otherwise `compute_fn` runs, its result is stored in
        the cache and returned. An exception from `compute_fn` reaches every waiter, and the
        key is no longer in flight afterwards, so a later call computes again.

        Unlike upstream, the computation runs in its own task and waiters are shielded from
        it: cancelling the caller that started it does not leave the other waiters hanging
        (upstream's shared future was never resolved in that case).
        """
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        task = self._in_flight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._compute(key, compute_fn))
            task.add_done_callback(_retrieve_exception)
            self._in_flight[key] = task
        else:
            logger.debug("Waiting for in-flight computation: key=%s...", key[:16])
        return await asyncio.shield(task)

    async def _compute(
        self, key: str, compute_fn: Callable[[], Awaitable[CachedEmbedding]]
    ) -> CachedEmbedding:
        try:
            entry = await compute_fn()
            self._cache.set(key, entry)
            return entry
        finally:
            self._in_flight.pop(key, None)

    @property
    def stats(self) -> dict[str, Any]:
        """The underlying cache's statistics plus `in_flight`, the keys being computed."""
        stats = dict(self._cache.stats)
        stats["in_flight"] = len(self._in_flight)
        return stats
