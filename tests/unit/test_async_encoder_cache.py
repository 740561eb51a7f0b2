"""`AsyncEncoderCache` over the real `MultimodalEmbeddingCacheManager`: request coalescing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dynamo.common.memory import CachedEmbedding, MultimodalEmbeddingCacheManager
from dynamo.common.multimodal import AsyncEncoderCache

pytestmark = pytest.mark.unit


class GatedEncoder:
    """An encoder that blocks until released and counts how often it ran."""

    def __init__(self, value: float = 1.0, error: Exception | None = None) -> None:
        self.calls = 0
        self.release = asyncio.Event()
        self.value = value
        self.error = error

    async def __call__(self) -> CachedEmbedding:
        self.calls += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return CachedEmbedding(tensor=torch.full((4, 8), self.value), image_grid_thw=[[1, 2, 2]])


def make_cache() -> AsyncEncoderCache:
    return AsyncEncoderCache(MultimodalEmbeddingCacheManager(capacity_bytes=1 << 20))


async def settle() -> None:
    """Let every ready task run until it blocks (one pass of the event loop)."""
    await asyncio.sleep(0)


async def test_concurrent_requests_for_one_key_run_the_encoder_once() -> None:
    cache = make_cache()
    encoder = GatedEncoder(3.0)
    tasks = [asyncio.create_task(cache.get_or_compute("img-1", encoder)) for _ in range(10)]
    await settle()
    # All ten are now waiting on the one computation: none found it in the cache.
    assert cache.stats["in_flight"] == 1
    assert cache.stats["misses"] == 10
    encoder.release.set()
    results = await asyncio.gather(*tasks)
    assert encoder.calls == 1
    assert all(result is results[0] for result in results)
    assert torch.equal(results[0].tensor, torch.full((4, 8), 3.0))
    assert cache.stats["in_flight"] == 0
    # Stored: the next request is a cache hit and the encoder is not called again.
    again = await cache.get_or_compute("img-1", encoder)
    assert again is results[0]
    assert encoder.calls == 1
    assert cache.stats["hits"] == 1
    assert cache.get("img-1") is results[0]


async def test_different_keys_compute_independently() -> None:
    cache = make_cache()
    first, second = GatedEncoder(1.0), GatedEncoder(2.0)
    a = asyncio.create_task(cache.get_or_compute("a", first))
    b = asyncio.create_task(cache.get_or_compute("b", second))
    await settle()
    assert cache.stats["in_flight"] == 2
    second.release.set()
    assert float((await b).tensor[0, 0]) == 2.0
    assert not a.done()
    first.release.set()
    assert float((await a).tensor[0, 0]) == 1.0


async def test_errors_reach_every_waiter_and_are_not_cached() -> None:
    cache = make_cache()
    failing = GatedEncoder(error=RuntimeError("encoder exploded"))
    tasks = [asyncio.create_task(cache.get_or_compute("k", failing)) for _ in range(3)]
    await settle()
    failing.release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and str(r) == "encoder exploded" for r in results)
    assert failing.calls == 1
    assert cache.stats["in_flight"] == 0
    assert cache.get("k") is None
    # The key is free again: the next request computes afresh.
    working = GatedEncoder(5.0)
    working.release.set()
    assert float((await cache.get_or_compute("k", working)).tensor[0, 0]) == 5.0
    assert working.calls == 1


async def test_cancelling_the_first_caller_does_not_strand_the_others() -> None:
    cache = make_cache()
    encoder = GatedEncoder(7.0)
    starter = asyncio.create_task(cache.get_or_compute("k", encoder))
    await settle()
    follower = asyncio.create_task(cache.get_or_compute("k", encoder))
    await settle()
    starter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starter
    encoder.release.set()
    result = await asyncio.wait_for(follower, timeout=10)
    assert float(result.tensor[0, 0]) == 7.0
    assert encoder.calls == 1
    assert cache.get("k") is result


async def test_stats_merge_the_underlying_cache_stats() -> None:
    cache = make_cache()
    encoder = GatedEncoder()
    encoder.release.set()
    await cache.get_or_compute("x", encoder)
    stats = cache.stats
    assert stats["entries"] == 1
    assert stats["current_bytes"] == 4 * 8 * 4
    assert stats["in_flight"] == 0
    assert {"capacity_bytes", "utilization", "hits", "misses", "evictions", "hit_rate"} <= set(
        stats
    )
