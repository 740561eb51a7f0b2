"""The cross-kind joins and wake decisions the handlers delegate to the reconcile packages:
a DynamoWorker as its adapters see it, pods joined to their DynamoWorkerMetadata, a
LoRAAdapter as its workers see it, and which objects a watch event wakes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_operator.api.dynamoworker import DEFAULT_MAX_LORAS
from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary, metadata_by_pod
from dynamo_operator.reconcile.loraadapter import wake
from dynamo_operator.reconcile.loraadapter.model import Pod
from dynamo_operator.reconcile.loraadapter.targeting import (
    AdapterRef,
    WorkerInfo,
    adapters_targeting,
)
from support.api_cases import lora_adapter

pytestmark = pytest.mark.unit


def adapter_body(
    name: str = "sql",
    spec: dict[str, Any] | None = None,
    *,
    generation: int = 2,
    observed: int | None = 2,
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body = lora_adapter(name, spec)
    body["metadata"] |= {
        "namespace": "ns",
        "uid": f"u-{name}",
        "generation": generation,
        "creationTimestamp": "2026-01-01T00:00:00Z",
    }
    body["status"] = {"observedGeneration": observed, **(status or {})}
    return body


def summary(name: str, *, ready: bool = True, containers_ready: bool = True) -> PodSummary:
    return PodSummary(
        name=name,
        uid=f"u-{name}",
        ip="198.18.0.9",
        ready=ready,
        terminating=False,
        containers_ready=containers_ready,
    )


@pytest.mark.parametrize(
    ("spec", "enabled", "max_loras"),
    [
        (None, False, None),
        ({"lora": {"enabled": True}}, True, DEFAULT_MAX_LORAS),
        ({"lora": {"enabled": True, "maxLoras": 2}}, True, 2),
        ({"lora": {"enabled": False, "maxLoras": "many"}}, False, None),
    ],
)
def test_worker_info_reads_the_raw_spec_with_the_models_defaults(
    spec: dict[str, Any] | None, enabled: bool, max_loras: int | None
) -> None:
    info = WorkerInfo.of("llm", {"tier": "a"}, spec)
    assert info == WorkerInfo("llm", {"tier": "a"}, lora_enabled=enabled, max_loras=max_loras)


def test_pods_are_joined_to_their_own_metadata_only() -> None:
    records = {"llm-a": DynamoWorkerMetadata.model_validate(_metadata("llm-a"))}
    pods = [summary("llm-a"), summary("llm-b")]
    joined = metadata_by_pod(pods, records.get)
    assert list(joined) == ["llm-a"]
    assert joined["llm-a"] is records["llm-a"]


def _metadata(pod: str) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoWorkerMetadata",
        "metadata": {"name": pod, "namespace": "ns"},
        "spec": {"data": {}},
    }


def test_adapter_ref_reads_the_pods_its_status_lists_as_loaded() -> None:
    body = adapter_body(
        spec={"requiredForReadiness": True},
        status={
            "pods": [
                {"pod": "llm-a", "worker": "llm", "state": "Loaded"},
                {"pod": "llm-b", "worker": "llm", "state": "Loading"},
            ]
        },
    )
    ref = AdapterRef.of_body(body)
    assert (ref.name, ref.worker_ref, ref.required) == ("sql", "llm", True)
    assert ref.loaded_on == frozenset({"llm-a"})
    with pytest.raises(ValidationError):
        AdapterRef.of_body({**body, "spec": {"source": {"uri": "s3://b/x"}}})


def test_adapters_target_known_workers_by_label_and_unknown_ones_by_name() -> None:
    by_name = AdapterRef.of_body(adapter_body("by-name"))
    by_label = AdapterRef.of_body(
        adapter_body("by-label", {"workerRef": None, "workerSelector": {"matchLabels": {"t": "a"}}})
    )
    workers = [WorkerInfo("other", {"t": "a"})]
    assert adapters_targeting("other", workers, [by_name, by_label]) == ["by-label"]
    # A worker just deleted is no longer indexed: an adapter naming it is still woken.
    assert adapters_targeting("llm", workers, [by_name, by_label]) == ["by-name"]


def test_an_adapter_loads_onto_pods_whose_containers_are_ready() -> None:
    # The readiness gate keeps the pod from Ready until its adapters are loaded.
    pod = Pod.of(summary("llm-a", ready=False, containers_ready=True), "llm")
    assert pod == Pod(name="llm-a", worker="llm", ip="198.18.0.9", ready=True, terminating=False)
    assert pod.eligible


WORKERS = [WorkerInfo("llm"), WorkerInfo("other")]


@pytest.mark.parametrize(
    ("event", "body", "woken"),
    [
        ("listing", adapter_body(generation=3, observed=2), wake.AdapterWake()),
        ("MODIFIED", adapter_body(), wake.AdapterWake()),  # our own status write
        ("MODIFIED", adapter_body(generation=3), wake.AdapterWake(True, ("llm",))),
        ("ADDED", adapter_body(generation=1, observed=None), wake.AdapterWake(False, ("llm",))),
        ("DELETED", adapter_body(), wake.AdapterWake(False, ("llm",))),
        # A required adapter's per-pod states open its workers' readiness gate.
        (
            "MODIFIED",
            adapter_body(spec={"requiredForReadiness": True}),
            wake.AdapterWake(False, ("llm",)),
        ),
        # An unreadable adapter targets nothing, but its daemon still reconciles.
        (
            "MODIFIED",
            {**adapter_body(generation=3), "spec": {"source": {"uri": "s3://b/x"}}},
            wake.AdapterWake(True, ()),
        ),
    ],
)
def test_which_objects_an_adapter_event_wakes(
    event: str, body: dict[str, Any], woken: wake.AdapterWake
) -> None:
    assert wake.on_adapter_event(None if event == "listing" else event, body, WORKERS) == woken


def test_pod_and_worker_events_wake_the_adapters_targeting_the_worker() -> None:
    adapters = [AdapterRef.of_body(adapter_body("sql")), AdapterRef.of_body(adapter_body("x"))]
    assert wake.on_pod_event("MODIFIED", "llm", WORKERS, adapters) == ["sql", "x"]
    assert wake.on_pod_event(None, "llm", WORKERS, adapters) == []
    assert wake.on_pod_event("DELETED", "other", WORKERS, adapters) == []
    assert wake.on_worker_event("ADDED", "llm", WORKERS, adapters) == ["sql", "x"]
    assert wake.on_worker_event("DELETED", "llm", [], adapters) == ["sql", "x"]
    # Other worker changes reach the adapters through its pods (or the resync).
    assert wake.on_worker_event("MODIFIED", "llm", WORKERS, adapters) == []
