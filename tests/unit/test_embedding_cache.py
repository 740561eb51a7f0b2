"""`MultimodalEmbeddingCacheManager`: byte-bounded LRU with add/remove deltas and stats."""

from __future__ import annotations

import logging

import pytest
import torch

from dynamo.common.memory import CachedEmbedding, CacheMutation, MultimodalEmbeddingCacheManager

pytestmark = pytest.mark.unit


def entry(num_bytes: int, fill: float = 0.0) -> CachedEmbedding:
    """An embedding whose tensor occupies exactly `num_bytes` (float32 elements)."""
    assert num_bytes % 4 == 0
    return CachedEmbedding(tensor=torch.full((num_bytes // 4,), fill, dtype=torch.float32))


def test_get_miss_and_hit_counts() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=1024)
    assert cache.get("a") is None
    stored = entry(64, 1.0)
    assert cache.set("a", stored) is True
    assert cache.get("a") is stored
    assert cache.stats == {
        "entries": 1,
        "current_bytes": 64,
        "capacity_bytes": 1024,
        "utilization": 64 / 1024,
        "hits": 1,
        "misses": 1,
        "evictions": 0,
        "hit_rate": 0.5,
    }


def test_size_uses_element_size_times_numel() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=10_000)
    cache.set("bf16", CachedEmbedding(torch.zeros(3, 100, dtype=torch.bfloat16)))
    assert cache.stats["current_bytes"] == 600


def test_lru_eviction_reports_removed_keys_in_lru_order() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=300)
    assert cache.set_with_delta("a", entry(100)) == CacheMutation(True, ["a"], [])
    assert cache.set_with_delta("b", entry(100)) == CacheMutation(True, ["b"], [])
    assert cache.set_with_delta("c", entry(100)) == CacheMutation(True, ["c"], [])
    cache.get("a")  # "b" is now least recently used
    assert cache.keys() == ["b", "c", "a"]
    mutation = cache.set_with_delta("d", entry(200))
    assert mutation == CacheMutation(True, ["d"], ["b", "c"])
    assert cache.keys() == ["a", "d"]
    assert cache.stats["evictions"] == 2
    assert cache.stats["current_bytes"] == 300


def test_replacing_a_key_is_not_an_addition_and_frees_old_bytes() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=300)
    cache.set("a", entry(100))
    cache.set("b", entry(100))
    mutation = cache.set_with_delta("a", entry(200, 2.0))
    # Old "a" (100 B) is dropped first, so only 100 + 200 = 300 B are needed: no eviction.
    assert mutation == CacheMutation(True, [], [])
    assert cache.keys() == ["b", "a"]
    assert cache.stats["current_bytes"] == 300
    cached = cache.get("a")
    assert cached is not None
    assert float(cached.tensor[0]) == 2.0


def test_entry_larger_than_capacity_is_not_stored(caplog: pytest.LogCaptureFixture) -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=100)
    cache.set("keep", entry(40))
    with caplog.at_level(logging.WARNING):
        assert cache.set_with_delta("huge", entry(104)) == CacheMutation(False, [], [])
    assert "Tensor too large to cache" in caplog.text
    assert cache.keys() == ["keep"]
    assert cache.set("huge", entry(104)) is False


def test_entry_exactly_at_capacity_evicts_everything_else() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=100)
    cache.set("a", entry(40))
    cache.set("b", entry(40))
    assert cache.set_with_delta("c", entry(100)) == CacheMutation(True, ["c"], ["a", "b"])
    assert cache.stats["utilization"] == 1.0


def test_zero_capacity_stores_nothing_and_reports_zero_utilization() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=0)
    assert cache.set("a", entry(4)) is False
    assert cache.stats["utilization"] == 0.0
    assert cache.stats["hit_rate"] == 0.0


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
        MultimodalEmbeddingCacheManager(capacity_bytes=-1)


def test_non_contiguous_tensor_is_rejected() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=10_000)
    strided = torch.zeros(10, 10).t()
    with pytest.raises(AssertionError, match="must be contiguous"):
        cache.set("t", CachedEmbedding(strided))


def test_metadata_travels_with_the_entry() -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=10_000)
    stored = CachedEmbedding(
        tensor=torch.ones(4),
        image_grid_thw=[[1, 2, 2]],
        video_grid_thw=None,
        second_per_grid_ts=0.5,
        video_timestamps=[0.0, 0.5],
    )
    cache.set("k", stored)
    assert cache.get("k") == stored
    assert len(cache) == 1
