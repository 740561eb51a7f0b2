"""The operator's own Prometheus metrics, on a registry of their own (built at startup).

- `dynamo_operator_reconcile_duration_seconds{kind}`: one reconcile of one object.
- `dynamo_operator_reconcile_errors_total{kind}`: reconciles that raised.
- `dynamo_operator_managed_objects{kind}`: objects the operator currently manages.
- `dynamo_operator_api_requests_total{verb,kind}`: requests the operator's client made to the
  API server (`verb` is get, apply, delete, patch-status, create, list); the write verbs are
  what "zero writes when converged" counts.
- `dynamo_operator_model_taint_pushes_total{result}`: model-taint POSTs to worker pods.
- `dynamo_operator_lora_load_duration_seconds`: from when a pod should serve an adapter's
  current source (the LoRAAdapter applied or edited, or the pod became a target) until the
  operator saw the pod list it, per pod.
- `dynamo_operator_lora_load_failures_total{reason}`: failed adapter loads, by CamelCase reason.
- `dynamo_operator_lora_adapters{namespace,pod}`: adapters each worker pod lists in
  `GET /v1/loras`, as last seen.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

WRITE_VERBS = frozenset({"apply", "delete", "patch-status", "create"})


class OperatorMetrics:
    """The metric families, registered on `registry` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconcile_duration = Histogram(
            "dynamo_operator_reconcile_duration_seconds",
            "Time one reconcile of one object took.",
            ["kind"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.reconcile_errors = Counter(
            "dynamo_operator_reconcile_errors",
            "Reconciles that failed (they are retried).",
            ["kind"],
            registry=self.registry,
        )
        self.managed_objects = Gauge(
            "dynamo_operator_managed_objects",
            "Objects the operator manages now.",
            ["kind"],
            registry=self.registry,
        )
        self.api_requests = Counter(
            "dynamo_operator_api_requests",
            "Requests the operator's client made to the Kubernetes API.",
            ["verb", "kind"],
            registry=self.registry,
        )
        self.taint_pushes = Counter(
            "dynamo_operator_model_taint_pushes",
            "POST /engine/update/model_taints requests to worker pods, by result.",
            ["result"],
            registry=self.registry,
        )

        self.lora_load_duration = Histogram(
            "dynamo_operator_lora_load_duration_seconds",
            "Time from a LoRAAdapter's source being wanted on a pod until the pod serves it.",
            registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
        )
        self.lora_load_failures = Counter(
            "dynamo_operator_lora_load_failures",
            "Adapter loads that failed, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.lora_adapters = Gauge(
            "dynamo_operator_lora_adapters",
            "LoRA adapters a worker pod lists (GET /v1/loras), as last seen.",
            ["namespace", "pod"],
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
