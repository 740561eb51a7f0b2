"""Upstream Dynamo's ZMQ event plane: KV events and KV load for upstream's router.

* `zmq_pub`: one topic's PUB socket and the four-frame message format;
* `kv_events`: `KvEventPublisher`, the engine-facing `publish_stored`/`publish_removed`
  with upstream's block hashing and contiguous event ids (`kv-events`);
* `kv_metrics`: `ActiveLoadPublisher` (`kv_metrics`), fed by the engine's snapshots.

`EventPlane` owns the sockets of one worker; discovery advertises each one as an
EventChannel record, and each KV-events publisher also as an EventSource (upstream's router
ingests a publisher's events only when a source record maps it to a worker and rank).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from dynamo.runtime.discovery.base import EventChannelAd
from dynamo.runtime.event_plane.kv_events import KV_EVENTS_TOPIC, KvEventPublisher
from dynamo.runtime.event_plane.kv_metrics import KV_METRICS_TOPIC, ActiveLoadPublisher
from dynamo.runtime.event_plane.zmq_pub import ZmqEventPublisher

# Publisher ids, like instance ids, must survive JSON readers (< 2**53).
_JSON_SAFE = (1 << 53) - 1

__all__ = ["EventPlane", "KvEventPublisher"]


class EventPlane:
    """The event-plane publishers of one worker process."""

    def __init__(
        self,
        *,
        worker_id: int,
        bind_host: str,
        advertised_host: str,
        on_kv_event_dropped: Callable[[], None] | None = None,
    ) -> None:
        """`on_kv_event_dropped` counts the KV events a channel had to drop."""
        self.worker_id = worker_id
        self._bind_host = bind_host
        self._advertised_host = advertised_host
        self._on_kv_event_dropped = on_kv_event_dropped
        self._channels: list[tuple[ZmqEventPublisher, int | None]] = []

    def _channel(
        self, topic: str, dp_rank: int | None, on_dropped: Callable[[], None] | None = None
    ) -> ZmqEventPublisher:
        # A fresh id per incarnation: the router treats two live publishers for one
        # (worker, rank) as ambiguous, and a restarted worker must not look like the old one.
        publisher_id = secrets.randbelow(_JSON_SAFE) + 1
        channel = ZmqEventPublisher(
            topic,
            publisher_id,
            bind_host=self._bind_host,
            advertised_host=self._advertised_host,
            on_dropped=on_dropped,
        )
        self._channels.append((channel, dp_rank))
        return channel

    def kv_events(self, dp_rank: int) -> KvEventPublisher:
        """A `kv-events` publisher for one data-parallel rank."""
        channel = self._channel(KV_EVENTS_TOPIC, dp_rank, self._on_kv_event_dropped)
        return KvEventPublisher(channel, worker_id=self.worker_id, dp_rank=dp_rank)

    def active_load(self) -> ActiveLoadPublisher:
        """The `kv_metrics` publisher (all ranks)."""
        return ActiveLoadPublisher(self._channel(KV_METRICS_TOPIC, None), worker_id=self.worker_id)

    def advertised(self) -> tuple[EventChannelAd, ...]:
        """What discovery publishes for these channels."""
        return tuple(
            EventChannelAd(
                topic=channel.topic,
                publisher_id=channel.publisher_id,
                endpoint=channel.endpoint,
                dp_rank=dp_rank,
            )
            for channel, dp_rank in self._channels
        )

    def close(self) -> None:
        """Close every socket (idempotent)."""
        for channel, _ in self._channels:
            channel.close()
