"""Embedding cache get/set operations per second with 10k entries.

Baseline in the same run: a bare `OrderedDict` LRU (move-to-end on get, pop-oldest on
set) without byte accounting, statistics or deltas.
Run: `.venv/bin/pytest -m bench -s tests/bench/bench_embedding_cache.py`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch

from dynamo.common.memory import CachedEmbedding, MultimodalEmbeddingCacheManager

pytestmark = pytest.mark.bench

ENTRIES = 10_000
ENTRY_BYTES = 1024  # 256 float32 values
OPERATIONS = 200_000
REPEATS = 3


def _entries() -> list[tuple[str, CachedEmbedding]]:
    tensor = torch.zeros(ENTRY_BYTES // 4, dtype=torch.float32)
    return [(f"{index:064x}", CachedEmbedding(tensor)) for index in range(2 * ENTRIES)]


def _best_rate(operation: Callable[[int], object]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for index in range(OPERATIONS):
            operation(index)
        best = min(best, time.perf_counter() - start)
    return OPERATIONS / best


def run() -> dict[str, float]:
    items = _entries()
    keys = [key for key, _ in items]
    resident = keys[:ENTRIES]

    cache = MultimodalEmbeddingCacheManager(capacity_bytes=ENTRIES * ENTRY_BYTES)
    for key, value in items[:ENTRIES]:
        cache.set(key, value)
    # Gets hit resident keys; sets insert new keys into a full cache, so each one evicts.
    get_rate = _best_rate(lambda i: cache.get(resident[i % ENTRIES]))
    set_rate = _best_rate(lambda i: cache.set(*items[i % (2 * ENTRIES)]))
    assert len(cache) == ENTRIES

    lru: OrderedDict[str, CachedEmbedding] = OrderedDict(items[:ENTRIES])

    def plain_get(i: int) -> object:
        key = resident[i % ENTRIES]
        value = lru.get(key)
        if value is not None:
            lru.move_to_end(key)
        return value

    def plain_set(i: int) -> object:
        key, value = items[i % (2 * ENTRIES)]
        lru.pop(key, None)
        if len(lru) >= ENTRIES:
            lru.popitem(last=False)
        lru[key] = value
        return True

    base_get = _best_rate(plain_get)
    base_set = _best_rate(plain_set)
    figures = {
        "get_ops_per_s": get_rate,
        "set_ops_per_s": set_rate,
        "get_ratio": get_rate / base_get,
        "set_ratio": set_rate / base_set,
    }
    print(
        f"Embedding cache ({ENTRIES} entries): get {get_rate:,.0f} ops/s "
        f"(ratio {figures['get_ratio']:.2f} vs bare OrderedDict {base_get:,.0f}); "
        f"set+evict {set_rate:,.0f} ops/s (ratio {figures['set_ratio']:.2f} vs {base_set:,.0f})"
    )
    return figures


def test_embedding_cache_throughput() -> None:
    figures = run()
    assert figures["get_ops_per_s"] > 0


if __name__ == "__main__":
    run()
