"""`PrefixCache`: the sample engine's KV-cache bookkeeping, reported as KV events.

Per data-parallel rank, the full `block_size`-token blocks of each prompt are kept in an LRU
cache of `capacity` blocks (the engine's total KV blocks), as a real engine's prefix cache
keeps them after a request ends. Blocks new to the cache are reported with
`publish_stored` (one event per contiguous run, with the engine id of the block before it as
`parent_hash`), blocks pushed out with `publish_removed`, on the publisher the runtime handed
over through `PushSource.on_ready`. A block's engine id depends on the adapter, the block's
tokens and its parent's id, so equal prefixes share blocks and different ones do not.
Generated tokens are not cached (only prompts).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any


def block_id(parent: int | None, tokens: list[int], adapter: str | None) -> int:
    """The engine's id of a block in its sequence context, a signed 64-bit integer as
    upstream engines report them."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"" if parent is None else parent.to_bytes(8, "big", signed=True))
    digest.update((adapter or "").encode() + b"\0")
    digest.update(b",".join(str(token).encode() for token in tokens))
    return int.from_bytes(digest.digest(), "big", signed=True)


class PrefixCache:
    """One rank's cached prompt blocks (see the module docstring)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.publisher: Any = None  # the runtime's KvEventPublisher, once attached
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def admit(self, token_ids: list[int], adapter: str | None) -> int:
        """Cache the prompt's full blocks; return how many were already cached (hits)."""
        size = self.block_size
        full = len(token_ids) // size
        ids: list[int] = []
        parent: int | None = None
        for index in range(full):
            parent = block_id(parent, token_ids[index * size : (index + 1) * size], adapter)
            ids.append(parent)
        new = [index for index, bid in enumerate(ids) if bid not in self._blocks]
        hits = full - len(new)
        for bid in ids:
            self._blocks[bid] = None
            self._blocks.move_to_end(bid)
        # Evict least recently used blocks, but never this prompt's own.
        keep = set(ids)
        evicted: list[int] = []
        for bid in list(self._blocks):
            if len(self._blocks) <= self.capacity:
                break
            if bid not in keep:
                del self._blocks[bid]
                evicted.append(bid)
        if self.publisher is not None:
            if evicted:
                self.publisher.publish_removed(evicted)
            for run in _runs(new):
                first, last = run[0], run[-1]
                self.publisher.publish_stored(
                    token_ids=token_ids[first * size : (last + 1) * size],
                    num_block_tokens=[size] * len(run),
                    block_hashes=[ids[index] for index in run],
                    parent_hash=ids[first - 1] if first > 0 else None,
                    lora_name=adapter,
                )
        return hits


def _runs(indexes: list[int]) -> list[list[int]]:
    """Consecutive runs in a sorted list of indexes."""
    runs: list[list[int]] = []
    for index in indexes:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
