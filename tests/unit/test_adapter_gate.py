"""The LoRA-adapters readiness gate: the pod template carries it only while a required
adapter targets the worker; each gated pod's condition is True exactly when every required
adapter is Loaded there; adapters target pods by their containers' readiness."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from dynamo_operator.api import DynamoWorker
from dynamo_operator.api.loraadapter import LoRAAdapter
from dynamo_operator.reconcile.dynamoworker.adapter_gate import wanted_condition
from dynamo_operator.reconcile.dynamoworker.builders import desired_children
from dynamo_operator.reconcile.dynamoworker.labels import ADAPTERS_READY_GATE
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.loraadapter.targeting import (
    AdapterRef,
    WorkerInfo,
    required_adapters,
)
from support.api_cases import dynamo_worker, lora_adapter

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def ref(
    name: str, required: bool, loaded_on: tuple[str, ...] = (), worker: str = "llm"
) -> AdapterRef:
    body = lora_adapter(name, {"workerRef": {"name": worker}, "requiredForReadiness": required})
    body["metadata"] |= {"namespace": "ns", "uid": f"u-{name}"}
    status = {"pods": [{"pod": p, "state": "Loaded"} for p in loaded_on]}
    return AdapterRef.of(LoRAAdapter.model_validate(body), status)


def pod_manifest(gated: bool, gate: str | None, containers_ready: bool = True) -> dict[str, Any]:
    conditions = [
        {"type": "ContainersReady", "status": "True" if containers_ready else "False"},
        {"type": "Ready", "status": "False"},
    ]
    if gate is not None:
        conditions.append({"type": ADAPTERS_READY_GATE, "status": gate})
    spec: dict[str, Any] = {}
    if gated:
        spec["readinessGates"] = [{"conditionType": ADAPTERS_READY_GATE}]
    return {
        "metadata": {"name": "llm-a", "uid": "p1"},
        "spec": spec,
        "status": {"podIP": "198.18.1.9", "conditions": conditions},
    }


def test_pod_summary_reads_the_gate_and_container_readiness() -> None:
    pod = PodSummary.from_pod(pod_manifest(gated=True, gate="False"))
    assert (pod.gated, pod.gate_status, pod.containers_ready, pod.ready) == (
        True,
        "False",
        True,
        False,
    )
    plain = PodSummary.from_pod(pod_manifest(gated=False, gate=None, containers_ready=False))
    assert (plain.gated, plain.gate_status, plain.containers_ready) == (False, None, False)


def test_required_adapters_are_those_targeting_the_worker() -> None:
    adapters = [
        ref("b", True),
        ref("a", True),
        ref("optional", False),
        ref("elsewhere", True, worker="other"),
    ]
    found = required_adapters(WorkerInfo(name="llm"), adapters)
    assert [a.name for a in found] == ["a", "b"]


@pytest.mark.parametrize(
    ("gate", "loaded", "wanted"),
    [
        (None, (), "False"),  # a new pod: not ready until loaded
        ("False", ("llm-a",), "True"),
        ("True", ("llm-a",), None),  # converged: no write
        ("True", (), "False"),  # the adapter went away from this pod
    ],
)
def test_condition_follows_where_the_adapters_are_loaded(
    gate: str | None, loaded: tuple[str, ...], wanted: str | None
) -> None:
    pod = PodSummary.from_pod(pod_manifest(gated=True, gate=gate))
    required = [ref("sql", True, loaded), ref("poet", True, ("llm-a",))]
    condition = wanted_condition(pod, required, T0)
    if wanted is None:
        assert condition is None
        return
    assert condition is not None
    assert (condition["type"], condition["status"]) == (ADAPTERS_READY_GATE, wanted)
    if wanted == "False":
        assert "sql" in condition["message"]
        assert "poet" not in condition["message"]
    assert condition["lastTransitionTime"] == "2026-01-01T12:00:00Z"


def test_ungated_or_terminating_pods_are_left_alone() -> None:
    assert wanted_condition(PodSummary.from_pod(pod_manifest(False, None)), [], T0) is None
    terminating = pod_manifest(True, None)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    assert wanted_condition(PodSummary.from_pod(terminating), [ref("a", True)], T0) is None


def test_the_template_carries_the_gate_only_when_asked() -> None:
    body = dynamo_worker("llm", {"lora": {"enabled": True}})
    body["metadata"] |= {"namespace": "ns", "uid": "u"}
    dw = DynamoWorker.model_validate(body)
    settings = ReconcileSettings(worker_image="w:1")

    def gates(adapters_gate: bool) -> Any:
        [deployment] = [
            c
            for c in desired_children(dw, settings, adapters_gate=adapters_gate)
            if c["kind"] == "Deployment"
        ]
        return deployment["spec"]["template"]["spec"].get("readinessGates")

    assert gates(False) is None
    assert gates(True) == [{"conditionType": ADAPTERS_READY_GATE}]
