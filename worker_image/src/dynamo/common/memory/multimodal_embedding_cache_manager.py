"""A byte-bounded LRU cache for multimodal encoder embeddings, keyed by content hash."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_GIB = 1024**3


class CachedEmbedding(NamedTuple):
    """An encoder output plus the grid/timing metadata the LLM needs alongside it."""

    tensor: torch.Tensor
    image_grid_thw: list[Any] | None = None
    video_grid_thw: list[Any] | None = None
    second_per_grid_ts: float | None = None
    video_timestamps: list[float] | None = None


class CacheMutation(NamedTuple):
    """What a store did: whether the entry was kept, and which keys appeared or went away.

    A replaced key is in neither list: it was present before and after.
    """

    stored: bool
    added_keys: list[str]
    removed_keys: list[str]


def _tensor_bytes(tensor: torch.Tensor) -> int:
    # element_size * numel is the storage used only for a contiguous tensor; a strided
    # view could pin a much larger storage than it reports. AssertionError with this text is
    # what upstream raises, and callers written for upstream catch that; raised explicitly
    # rather than by `assert`, so that `python -O` keeps the check.
    if not tensor.is_contiguous():
        raise AssertionError(
            "Tensor must be contiguous for accurate size calculation; "
            "call .contiguous() on it first"
        )
    return int(tensor.element_size() * tensor.numel())


class MultimodalEmbeddingCacheManager:
    """LRU cache for encoder embeddings.

    Stores tensors keyed by content hash and evicts least-recently-used entries when the
    total tensor bytes would exceed `capacity_bytes`.

    Not thread-safe: it is meant for one thread (e.g. an asyncio event loop), which keeps
    it free of locking overhead.
    """

    def __init__(self, capacity_bytes: int) -> None:
        """Create an empty cache holding at most `capacity_bytes` bytes of tensors."""
        if capacity_bytes < 0:
            raise ValueError(
                f"capacity_bytes must be >= 0, got {capacity_bytes}; use 0 to disable caching"
            )
        # key -> (entry, its size in bytes); oldest first.
        self._entries: OrderedDict[str, tuple[CachedEmbedding, int]] = OrderedDict()
        self._capacity_bytes = capacity_bytes
        self._current_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        logger.info(
            "MultimodalEmbeddingCacheManager initialized: capacity=%.2fGB",
            capacity_bytes / _GIB,
        )

    def get(self, key: str) -> CachedEmbedding | None:
        """Return the entry for `key` (marking it most recently used), or None."""
        found = self._entries.get(key)
        if found is None:
            self._misses += 1
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        return found[0]

    def keys(self) -> list[str]:
        """Return the current cache keys in LRU order (least recently used first)."""
        return list(self._entries)

    def set(self, key: str, entry: CachedEmbedding) -> bool:
        """Store `entry` under `key`; return whether it was stored (see `set_with_delta`)."""
        return self.set_with_delta(key, entry).stored

    def set_with_delta(self, key: str, entry: CachedEmbedding) -> CacheMutation:
        """Store `entry` under `key` and report the keys added and evicted.

        An existing value for `key` is replaced. Least-recently-used entries are evicted
        until the new entry fits. An entry larger than the whole capacity is not stored
        (and an existing value for `key` is left as it was).
        """
        size = _tensor_bytes(entry.tensor)
        if size > self._capacity_bytes:
            logger.warning(
                "Tensor too large to cache: %.1fMB > %.2fGB capacity",
                size / 1024**2,
                self._capacity_bytes / _GIB,
            )
            return CacheMutation(False, [], [])

        replaced = self._entries.pop(key, None)
        if replaced is not None:
            self._current_bytes -= replaced[1]

        removed_keys: list[str] = []
        while self._current_bytes + size > self._capacity_bytes:
            evicted_key, (_, evicted_size) = self._entries.popitem(last=False)
            self._current_bytes -= evicted_size
            self._evictions += 1
            removed_keys.append(evicted_key)

        self._entries[key] = (entry, size)
        self._current_bytes += size
        added_keys = [] if replaced is not None else [key]
        return CacheMutation(True, added_keys, removed_keys)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> dict[str, Any]:
        """Entries, bytes used and capacity, utilization, hits, misses, evictions, hit rate."""
        lookups = self._hits + self._misses
        return {
            "entries": len(self._entries),
            "current_bytes": self._current_bytes,
            "capacity_bytes": self._capacity_bytes,
            "utilization": (
                self._current_bytes / self._capacity_bytes if self._capacity_bytes > 0 else 0.0
            ),
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
            "hit_rate": self._hits / lookups if lookups > 0 else 0.0,
        }
