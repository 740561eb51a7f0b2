"""The operator's own Prometheus metrics, on a registry of their own (built at startup).

- `dynamo_operator_reconcile_duration_seconds{kind}`: one reconcile of one object.
- `dynamo_operator_reconcile_errors_total{kind}`: reconciles that raised.
- `dynamo_operator_managed_objects{kind}`: objects the operator currently manages.
- `dynamo_operator_leader`: 1 while this replica leads (holds the Lease and reconciles), 0 as
  a standby; `dynamo_operator_leader_changes_total{change}`: acquired, released, lost.
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
- `dynamo_operator_status_condition{kind,namespace,name,type}`: 1 while a managed object's
  condition (Ready, Progressing, Degraded) is True, else 0, from the status the operator
  computed last (the chart's alerts and dashboard read it).
- `dynamo_operator_autoscaler_load{namespace,name,signal}`: the load the autoscaler last read
  of a DynamoWorker with spec.autoscaling, per signal (`in_flight` and `held` requests,
  `kv_cache_percent` summed over pods, `ttft_p90_seconds`), and
  `dynamo_operator_autoscaler_desired_replicas{namespace,name}`: the count it wants. A KEDA
  Prometheus trigger can scale on the same signal.
- `dynamo_operator_dynamoworker_desired_replicas{namespace,name}` and
  `dynamo_operator_dynamoworker_ready_replicas{namespace,name}`: `spec.replicas` and
  `status.readyReplicas` of each DynamoWorker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

WRITE_VERBS = frozenset({"apply", "delete", "patch-status", "create", "patch"})
MANAGED_KINDS = ("DynamoWorker", "LoRAAdapter")
AUTOSCALER_SIGNALS = ("in_flight", "held", "kv_cache_percent", "ttft_p90_seconds")


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
        self.leader = Gauge(
            "dynamo_operator_leader",
            "1 while this replica holds the leader-election Lease and reconciles, 0 while it "
            "is a standby (always 1 without leader election).",
            registry=self.registry,
        )
        self.leader_changes = Counter(
            "dynamo_operator_leader_changes",
            "Times this replica became leader (acquired) or stopped leading (released, lost).",
            ["change"],
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

        self.status_condition = Gauge(
            "dynamo_operator_status_condition",
            "Conditions of managed objects: 1 while the condition is True, else 0.",
            ["kind", "namespace", "name", "type"],
            registry=self.registry,
        )
        self.desired_replicas = Gauge(
            "dynamo_operator_dynamoworker_desired_replicas",
            "Worker pods a DynamoWorker asks for (spec.replicas).",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.ready_replicas = Gauge(
            "dynamo_operator_dynamoworker_ready_replicas",
            "Ready worker pods of a DynamoWorker (status.readyReplicas).",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.autoscaler_load = Gauge(
            "dynamo_operator_autoscaler_load",
            "The load the autoscaler last read of a DynamoWorker, per signal.",
            ["namespace", "name", "signal"],
            registry=self.registry,
        )
        self.autoscaler_desired = Gauge(
            "dynamo_operator_autoscaler_desired_replicas",
            "Worker pods the autoscaler wants for a DynamoWorker.",
            ["namespace", "name"],
            registry=self.registry,
        )
        # Per object: the condition types it has gauges for (dropped with the object).
        self._condition_types: dict[tuple[str, str, str], set[str]] = {}
        # Both kinds from the start: the error counters at 0 (so rate() has a series before
        # the first error), and the gauge whose absence means that no operator is running
        # (the chart's DynamoOperatorAbsent alert).
        for kind in MANAGED_KINDS:
            self.reconcile_errors.labels(kind=kind)
            self.managed_objects.labels(kind=kind)

    def record_status(
        self,
        kind: str,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        desired_replicas: int | None = None,
    ) -> None:
        """Set the condition gauges of one object from the `status` it was given (camelCase,
        as written), and its replica gauges when `desired_replicas` is known."""
        types = self._condition_types.setdefault((kind, namespace, name), set())
        for condition in status.get("conditions") or []:
            value = 1.0 if condition.get("status") == "True" else 0.0
            self.status_condition.labels(kind, namespace, name, condition["type"]).set(value)
            types.add(condition["type"])
        if desired_replicas is not None:
            self.desired_replicas.labels(namespace, name).set(desired_replicas)
            self.ready_replicas.labels(namespace, name).set(status.get("readyReplicas", 0))

    def forget_object(self, kind: str, namespace: str, name: str) -> None:
        """Drop the gauges of an object that is gone."""
        for type_ in self._condition_types.pop((kind, namespace, name), set()):
            self.status_condition.remove(kind, namespace, name, type_)
        if kind == "DynamoWorker":
            for gauge in (self.desired_replicas, self.ready_replicas):
                with contextlib.suppress(KeyError):  # no status was ever recorded
                    gauge.remove(namespace, name)
            self.forget_autoscaler(namespace, name)

    def forget_autoscaler(self, namespace: str, name: str) -> None:
        """Drop a DynamoWorker's autoscaler gauges (it is gone, or no longer autoscaled)."""
        with contextlib.suppress(KeyError):
            self.autoscaler_desired.remove(namespace, name)
        for signal in AUTOSCALER_SIGNALS:
            with contextlib.suppress(KeyError):
                self.autoscaler_load.remove(namespace, name, signal)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
