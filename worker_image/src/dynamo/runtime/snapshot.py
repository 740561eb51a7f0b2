"""`SnapshotPublisher`: per-data-parallel-rank KV gauges fed by the engine.

Created when the engine declares ranks (`component_metrics_dp_ranks()`) and KV routing is
enabled, then handed to the engine through `attach_snapshot_publisher`. The engine calls
`publish(rank, snapshot)` from any thread whenever its KV usage changes. Gauges carry a
`dp_rank` label; `total_blocks` and `gpu_cache_usage_percent` start at 0 for every declared
rank, `kv_cache_hit_rate` appears with the first measurement.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Gauge

from dynamo.common.backend.publisher import ComponentSnapshot
from dynamo.runtime.metrics import PREFIX

logger = logging.getLogger(__name__)


class SnapshotPublisher:
    """Turns `ComponentSnapshot`s into the per-rank gauges."""

    def __init__(
        self, registry: CollectorRegistry, labels: dict[str, str], dp_ranks: Iterable[int]
    ) -> None:
        self._labels = dict(labels)
        self.dp_ranks = tuple(dict.fromkeys(int(rank) for rank in dp_ranks))
        names = [*self._labels, "dp_rank"]
        self._total_blocks = Gauge(
            PREFIX + "total_blocks", "KV cache blocks of the rank", names, registry=registry
        )
        self._usage = Gauge(
            PREFIX + "gpu_cache_usage_percent",
            "Fraction of the rank's KV cache in use (0.0-1.0)",
            names,
            registry=registry,
        )
        self._hit_rate = Gauge(
            PREFIX + "kv_cache_hit_rate",
            "Prefix cache hit rate of the rank (0.0-1.0)",
            names,
            registry=registry,
        )
        self._warned: set[int] = set()
        self._lock = threading.Lock()
        for rank in self.dp_ranks:
            self._total_blocks.labels(**self._rank_labels(rank)).set(0)
            self._usage.labels(**self._rank_labels(rank)).set(0)

    def _rank_labels(self, rank: int) -> dict[str, str]:
        return {**self._labels, "dp_rank": str(rank)}

    def publish(self, dp_rank: int, snapshot: ComponentSnapshot) -> None:
        """Record `snapshot` (its own `dp_rank` picks the gauges; `dp_rank` is the
        publisher slot, kept for upstream's signature). Errors are logged once per rank."""
        del dp_rank
        try:
            labels = self._rank_labels(int(snapshot.dp_rank))
            self._total_blocks.labels(**labels).set(int(snapshot.kv_total_blocks))
            self._usage.labels(**labels).set(float(snapshot.gpu_cache_usage))
            if snapshot.kv_cache_hit_rate is not None:
                self._hit_rate.labels(**labels).set(float(snapshot.kv_cache_hit_rate))
        except Exception:
            rank = getattr(snapshot, "dp_rank", -1)
            with self._lock:
                first = rank not in self._warned
                self._warned.add(rank)
            if first:
                logger.warning("bad component snapshot for rank %s: %r", rank, snapshot)
