"""`KvEventPublisher`: an engine's KV-cache events on the `kv-events` topic.

Engines get one per data-parallel rank through `PushSource.on_ready` and call upstream's
methods on it: `publish_stored(token_ids, num_block_tokens, block_hashes, parent_hash=None,
..., lora_name=None, cache_salt=None)` when blocks enter the prefix cache and
`publish_removed(block_hashes)` when they leave it. Each becomes one RouterEvent (a
one-element msgpack array) `{"worker_id", "storage_tier": "device", "event": {"event_id",
"dp_rank", "data": {"stored": {...}} | {"removed": {...}}}}` with event ids contiguous from 0
per publisher (the router resets a rank's index on a gap).

`block_hash` is the engine's own id for a block in its sequence context (signed 64-bit
values are sent as their unsigned bits). `tokens_hash` is the router's hash of the block's
tokens: XXH3-64 of the token ids as little-endian u32, seeded with 1337, plus (wrapping at
2**64) XXH3-64 of the LoRA adapter's name with seed 0 and of the cache salt with seed 1.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Sequence
from typing import Any

import xxhash

from dynamo.runtime.event_plane.zmq_pub import ZmqEventPublisher

logger = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv-events"
BLOCK_HASH_SEED = 1337
_U64_MASK = (1 << 64) - 1


def hash_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The XXH3 seed the router uses for blocks of `lora_name` with `cache_salt`."""
    seed = BLOCK_HASH_SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), seed=0)
    if cache_salt:
        seed += xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8"), seed=1)
    return seed & _U64_MASK


def tokens_hash(tokens: Sequence[int], seed: int = BLOCK_HASH_SEED) -> int:
    """The router's hash of one block's token ids."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)


class KvEventPublisher:
    """Publishes one data-parallel rank's KV events (upstream's engine-facing methods)."""

    def __init__(self, channel: ZmqEventPublisher, *, worker_id: int, dp_rank: int) -> None:
        self.channel = channel
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self._next_event_id = 0
        self._lock = threading.Lock()  # engines may publish from their own threads

    def publish_stored(
        self,
        token_ids: list[int],
        num_block_tokens: list[int],
        block_hashes: list[int],
        parent_hash: int | None = None,
        block_mm_infos: list[dict[str, Any] | None] | None = None,
        lora_name: str | None = None,
        is_eagle: bool | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Blocks entered the cache: `token_ids` are the blocks' tokens back to back,
        `num_block_tokens[i]` how many belong to block i, `block_hashes[i]` its engine id,
        `parent_hash` the engine id of the block before the first one (None at position 0)."""
        del is_eagle  # eagle's overlapping windows are not supported; plain blocks are hashed
        if len(num_block_tokens) != len(block_hashes):
            raise ValueError(
                f"publish_stored: {len(block_hashes)} block_hashes but "
                f"{len(num_block_tokens)} num_block_tokens; give one count per block"
            )
        if sum(num_block_tokens) != len(token_ids):
            raise ValueError(
                f"publish_stored: num_block_tokens add up to {sum(num_block_tokens)} but "
                f"{len(token_ids)} token_ids were given"
            )
        seed = hash_seed(lora_name, cache_salt)
        blocks = []
        start = 0
        for index, (count, block_hash) in enumerate(
            zip(num_block_tokens, block_hashes, strict=True)
        ):
            mm_info = block_mm_infos[index] if block_mm_infos else None
            blocks.append(
                {
                    "block_hash": block_hash & _U64_MASK,
                    "tokens_hash": tokens_hash(token_ids[start : start + count], seed),
                    "mm_extra_info": mm_info,
                }
            )
            start += count
        stored = {
            "parent_hash": None if parent_hash is None else parent_hash & _U64_MASK,
            "start_position": None,
            "blocks": blocks,
        }
        self._publish({"stored": stored})

    def publish_removed(self, block_hashes: list[int]) -> None:
        """Blocks left the cache (engine ids, as given to `publish_stored`)."""
        self._publish({"removed": {"block_hashes": [h & _U64_MASK for h in block_hashes]}})

    def publish_cleared(self) -> None:
        """Every block of this rank left the cache."""
        self._publish("cleared")

    def shutdown(self) -> None:
        """Nothing to do: the runtime closes the channel at shutdown."""

    def _publish(self, data: Any) -> None:
        with self._lock:
            event = {"event_id": self._next_event_id, "dp_rank": self.dp_rank, "data": data}
            self._next_event_id += 1
            self.channel.publish(
                [{"worker_id": self.worker_id, "storage_tier": "device", "event": event}]
            )
