"""`ActiveLoadPublisher`: the worker's KV load on the `kv_metrics` topic.

Upstream's frontend subscribes to it for busy-worker thresholds and its own metrics. Each
message is an ActiveLoad map `{"worker_id", "dp_rank", "active_decode_blocks",
"active_prefill_tokens", "kv_used_blocks"}`, sent when a rank's used blocks change. It is fed
the same `ComponentSnapshot`s the engine publishes for the per-rank gauges (see `SnapshotTee`).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from dynamo.common.backend.publisher import ComponentSnapshot
from dynamo.runtime.event_plane.zmq_pub import ZmqEventPublisher

KV_METRICS_TOPIC = "kv_metrics"


class SnapshotSink(Protocol):
    """Anything with upstream's `SnapshotPublisher.publish(rank, snapshot)`."""

    def publish(self, dp_rank: int, snapshot: ComponentSnapshot) -> None:
        """Take one snapshot."""


class ActiveLoadPublisher:
    """Publishes ActiveLoad when a rank's `kv_used_blocks` changes."""

    def __init__(self, channel: ZmqEventPublisher, *, worker_id: int) -> None:
        self.channel = channel
        self.worker_id = worker_id
        self._last: dict[int, int] = {}
        self._lock = threading.Lock()

    def publish(self, dp_rank: int, snapshot: ComponentSnapshot) -> None:
        """Take one snapshot (the snapshot's own `dp_rank` names the rank)."""
        del dp_rank
        rank, used = int(snapshot.dp_rank), int(snapshot.kv_used_blocks)
        with self._lock:
            if self._last.get(rank) == used:
                return
            self._last[rank] = used
        load: dict[str, Any] = {
            "worker_id": self.worker_id,
            "dp_rank": rank,
            "active_decode_blocks": None,
            "active_prefill_tokens": None,
            "kv_used_blocks": used,
        }
        self.channel.publish(load)


class SnapshotTee:
    """Hands each snapshot to several publishers (the gauges and the event plane)."""

    def __init__(self, *sinks: SnapshotSink) -> None:
        self.sinks = sinks

    def publish(self, dp_rank: int, snapshot: ComponentSnapshot) -> None:
        """Pass `snapshot` to every sink."""
        for sink in self.sinks:
            sink.publish(dp_rank, snapshot)
