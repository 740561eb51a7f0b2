"""How an engine feeds KV-cache events and load snapshots to the router."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The runtime's KV event publisher handed to push sources; engines call its methods to
# publish "stored"/"removed" block events.
KvEventPublisher = Any


@dataclass(frozen=True)
class ZmqSource:
    """KV events read from an engine's ZMQ PUB socket at `endpoint` (filtered by `topic`)."""

    endpoint: str
    topic: str = ""
    dp_rank: int = 0


@dataclass(frozen=True)
class PushSource:
    """KV events pushed by the engine itself through the publisher given to `on_ready`.

    The engine owns whatever thread pushes the events and must stop it in `cleanup`.
    """

    on_ready: Callable[[KvEventPublisher], None]
    dp_rank: int = 0


KvEventSource = ZmqSource | PushSource


@dataclass
class ComponentSnapshot:
    """One data-parallel rank's KV usage, published through the snapshot publisher.

    `kv_cache_hit_rate` is tri-state: None means no data or no prefix cache (the gauge is
    skipped); 0.0 is a real measurement.
    """

    kv_used_blocks: int
    kv_total_blocks: int
    gpu_cache_usage: float
    dp_rank: int
    kv_cache_hit_rate: float | None = None
