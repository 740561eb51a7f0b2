"""The operator's per-object gauges (what the chart's alerts and dashboard read): conditions
and replicas from the status the operator computed, dropped with the object, and the series
that exist from the start (the error counters, the gauge whose absence means no operator)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_operator.api.dynamoworker import DynamoWorkerStatus
from dynamo_operator.metrics import OperatorMetrics

pytestmark = pytest.mark.unit

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(metrics: OperatorMetrics) -> Samples:
    found = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def condition(
    kind: str, namespace: str, name: str, type_: str
) -> tuple[str, tuple[tuple[str, str], ...]]:
    labels = {"kind": kind, "namespace": namespace, "name": name, "type": type_}
    return ("dynamo_operator_status_condition", tuple(sorted(labels.items())))


def worker_status(ready: int, ready_condition: str) -> dict[str, object]:
    """A status as the operator writes it (camelCase, from the model)."""
    return DynamoWorkerStatus.model_validate(
        {
            "replicas": 3,
            "readyReplicas": ready,
            "conditions": [
                {"type": "Ready", "status": ready_condition, "reason": "WaitingForPods",
                 "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Degraded", "status": "False", "reason": "AsExpected",
                 "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ],
        }
    ).to_dict()  # fmt: skip


def test_conditions_and_replicas_follow_the_status() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("DynamoWorker", "team", "llm", worker_status(1, "False"), 3)
    found = samples(metrics)
    assert found[condition("DynamoWorker", "team", "llm", "Ready")] == 0.0
    assert found[condition("DynamoWorker", "team", "llm", "Degraded")] == 0.0
    labels = (("name", "llm"), ("namespace", "team"))
    assert found[("dynamo_operator_dynamoworker_desired_replicas", labels)] == 3.0
    assert found[("dynamo_operator_dynamoworker_ready_replicas", labels)] == 1.0

    metrics.record_status("DynamoWorker", "team", "llm", worker_status(3, "True"), 3)
    found = samples(metrics)
    assert found[condition("DynamoWorker", "team", "llm", "Ready")] == 1.0
    assert found[("dynamo_operator_dynamoworker_ready_replicas", labels)] == 3.0


def test_an_adapter_has_conditions_and_no_replica_gauges() -> None:
    metrics = OperatorMetrics()
    status = {"conditions": [{"type": "Degraded", "status": "True"}]}
    metrics.record_status("LoRAAdapter", "team", "sql", status)
    found = samples(metrics)
    assert found[condition("LoRAAdapter", "team", "sql", "Degraded")] == 1.0
    assert not [key for key in found if key[0].startswith("dynamo_operator_dynamoworker_")]


def test_forgetting_an_object_drops_only_its_gauges() -> None:
    metrics = OperatorMetrics()
    metrics.record_status("DynamoWorker", "team", "gone", worker_status(0, "False"), 2)
    metrics.record_status("DynamoWorker", "team", "kept", worker_status(2, "True"), 2)
    metrics.record_status(
        "LoRAAdapter", "team", "gone", {"conditions": [{"type": "Ready", "status": "True"}]}
    )
    metrics.forget_object("DynamoWorker", "team", "gone")
    metrics.forget_object("DynamoWorker", "team", "never-seen")
    names = {dict(labels).get("name") for _, labels in samples(metrics) if labels}
    found = samples(metrics)
    assert condition("DynamoWorker", "team", "gone", "Ready") not in found
    assert condition("LoRAAdapter", "team", "gone", "Ready") in found
    assert condition("DynamoWorker", "team", "kept", "Ready") in found
    assert (
        "dynamo_operator_dynamoworker_desired_replicas",
        (("name", "gone"), ("namespace", "team")),
    ) not in found
    assert "kept" in names


def test_both_kinds_have_series_from_the_start() -> None:
    found = samples(OperatorMetrics())
    for kind in ("DynamoWorker", "LoRAAdapter"):
        assert found[("dynamo_operator_reconcile_errors_total", (("kind", kind),))] == 0.0
        assert found[("dynamo_operator_managed_objects", (("kind", kind),))] == 0.0
