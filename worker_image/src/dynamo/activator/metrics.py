"""The activator's Prometheus metrics (its own registry, served at the system port's /metrics).

The operator's autoscaler reads `dynamo_activator_held_requests` (unlabelled: the requests
waiting now, its demand signal) and `dynamo_activator_card_ready` (1 while the activator
holds a model card, so it can keep the model listed at zero).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Hold times range from milliseconds (a pod was ready) to minutes (a cold start).
_WAIT_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 180, 300, 600)


class ActivatorMetrics:
    """Every metric the activator exports, in one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.held = Gauge(
            "dynamo_activator_held_requests",
            "Requests held now, waiting for a ready worker pod",
            registry=self.registry,
        )
        self.wait_seconds = Histogram(
            "dynamo_activator_wait_seconds",
            "Time a request waited until it was forwarded to a worker pod",
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.expired = Counter(
            "dynamo_activator_expired",
            "Requests answered 503 because no suitable pod became ready in time",
            registry=self.registry,
        )
        self.refused = Counter(
            "dynamo_activator_refused",
            "Requests refused at once because the hold was full",
            registry=self.registry,
        )
        self.forwarded = Counter(
            "dynamo_activator_forwarded",
            "Requests forwarded to a worker pod",
            registry=self.registry,
        )
        self.card_ready = Gauge(
            "dynamo_activator_card_ready",
            "1 while the activator holds the model cards a worker pod published, else 0",
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
