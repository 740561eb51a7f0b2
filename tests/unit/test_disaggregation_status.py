"""Disaggregated serving (spec.prefill) in status, in a LoRAAdapter's per-pod status, and in the
reconciler: status.prefill and the pods' roles, Ready waiting for both roles, the prefill
Deployment's rollout and failures, and the prefill children removed with spec.prefill."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from dynamo_operator.api import DynamoWorker
from dynamo_operator.api.dynamoworker import DECODE, PREFILL, WorkerRole
from dynamo_operator.api.kv_transfer import KvTransferStatus
from dynamo_operator.api.loraadapter import LoRAAdapter, LoRAAdapterStatus
from dynamo_operator.k8s.client import Cluster
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from dynamo_operator.reconcile.dynamoworker.reconciler import WorkerReconciler
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.dynamoworker.status import (
    WorkerObservation,
    compute_status,
    status_hold_seconds,
)
from dynamo_operator.reconcile.loraadapter import plan as planner
from dynamo_operator.reconcile.loraadapter.model import AdapterObservation, Pod
from dynamo_operator.reconcile.loraadapter.targeting import WorkerInfo
from support.api_cases import dynamo_worker, lora_adapter
from support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def worker(prefill: dict[str, Any] | None = None) -> DynamoWorker:
    spec: dict[str, Any] = {"replicas": 2, "engine": {"name": "vllm"}}
    if prefill is not None:
        spec["prefill"] = prefill
    body = dynamo_worker("llm", spec)
    body["metadata"] |= {"namespace": "ns", "uid": "u-1", "generation": 3}
    return DynamoWorker.model_validate(body)


def deployment(
    name: str,
    *,
    replicas: int = 2,
    ready: int = 2,
    updated: int = 2,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "generation": 5},
        "status": {
            "observedGeneration": 5,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": conditions or [],
        },
    }


def pod(name: str, role: WorkerRole | None, ready: bool = True) -> PodSummary:
    return PodSummary(
        name=name, uid=f"uid-{name}", ip="198.18.0.9", ready=ready, terminating=False, role=role
    )


def condition(status: dict[str, Any], type_: str) -> tuple[str, str, str]:
    c = next(c for c in status["conditions"] if c["type"] == type_)
    return c["status"], c["reason"], c["message"]


def observe(prefill: dict[str, Any] | None, **kwargs: Any) -> dict[str, Any]:
    pods = [pod("llm-a", DECODE), pod("llm-b", DECODE), pod("llm-prefill-a", PREFILL)]
    observation = WorkerObservation(
        now=T0, deployment=deployment("llm"), pods=pods, **{"prefill_deployment": prefill, **kwargs}
    )
    return compute_status(worker({"replicas": 1}), observation)


def test_both_roles_ready_is_ready_with_the_prefill_counts_and_pod_roles() -> None:
    status = observe(deployment("llm-prefill", replicas=1, ready=1, updated=1))
    assert condition(status, "Ready")[:2] == ("True", "AllReplicasReady")
    assert condition(status, "Progressing")[:2] == ("False", "RolloutComplete")
    assert condition(status, "Degraded")[:2] == ("False", "AsExpected")
    assert status["prefill"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    # The top-level counts are the decode pods'.
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert status["selector"] == "dynamo.dev/worker=llm"
    assert {p["name"]: p["role"] for p in status["pods"]} == {
        "llm-a": "decode",
        "llm-b": "decode",
        "llm-prefill-a": "prefill",
    }


@pytest.mark.parametrize(
    ("prefill", "message"),
    [
        (None, "the prefill Deployment does not exist yet; see status.prefill"),
        (
            deployment("llm-prefill", replicas=1, ready=0, updated=1),
            "0 of 1 prefill pods are ready, 1 run the current spec; see status.prefill",
        ),
        # Ready, but on an earlier spec: it could not hand its KV cache to the decode pods.
        (
            deployment("llm-prefill", replicas=2, ready=1, updated=0),
            "1 of 1 prefill pods are ready, 0 run the current spec; see status.prefill",
        ),
    ],
)
def test_a_lagging_prefill_role_keeps_the_worker_unready(
    prefill: dict[str, Any] | None, message: str
) -> None:
    status = observe(prefill)
    assert condition(status, "Ready") == ("False", "PrefillNotReady", message)


def test_the_prefill_rollout_is_progress() -> None:
    status = observe(None)
    assert condition(status, "Progressing") == (
        "True",
        "Creating",
        "creating the prefill Deployment",
    )
    status = observe(deployment("llm-prefill", replicas=2, ready=1, updated=0))
    assert condition(status, "Progressing") == (
        "True",
        "RollingOut",
        "0 of 1 prefill pods run generation 3 of the spec (2 prefill pods in all)",
    )


def test_a_failing_prefill_deployment_is_a_degradation() -> None:
    failure = {"type": "ReplicaFailure", "status": "True", "message": "quota exceeded"}
    status = observe(deployment("llm-prefill", ready=0, updated=0, conditions=[failure]))
    assert condition(status, "Degraded") == (
        "True",
        "ReplicaFailure",
        "the prefill Deployment cannot create pods: quota exceeded",
    )


def test_each_roles_kv_transfers_are_in_status_and_a_failing_one_degrades() -> None:
    ready = deployment("llm-prefill", replicas=1, ready=1, updated=1)
    healthy = {
        DECODE: KvTransferStatus(
            health="Healthy", transfers=4, bytes_transferred=4096, pods_read=2
        ),
        PREFILL: KvTransferStatus(health="Healthy", pods_read=1),
    }
    status = observe(ready, kv_transfer=healthy)
    assert status["kvTransfer"] == {
        "health": "Healthy",
        "transfers": 4,
        "bytesTransferred": 4096,
        "failedTransfers": 0,
        "expiredRequests": 0,
        "podsRead": 2,
    }
    assert status["prefill"]["kvTransfer"]["health"] == "Healthy"
    assert condition(status, "Degraded")[:2] == ("False", "AsExpected")

    failing = {
        DECODE: KvTransferStatus(health="Failing", failed_transfers=2, last_failure_time=T0),
        PREFILL: KvTransferStatus(health="Failing", expired_requests=1, last_failure_time=T0),
    }
    status = observe(ready, kv_transfer=failing)
    assert status["kvTransfer"]["lastFailureTime"] == "2026-01-01T12:00:00Z"
    assert condition(status, "Degraded") == (
        "True",
        "KvTransferFailing",
        "KV-cache transfers between the roles failed in the last 300 s: decode pods count 2 "
        "failed transfers; prefill pods count 0 failed transfers and 1 requests whose blocks "
        "expired unpulled; see status.kvTransfer and status.prefill.kvTransfer, and check that "
        "the NIXL side-channel and UCX ports are open between the roles' pods",
    )
    # Nothing read yet (a new leader keeps what status showed; see the reconciler).
    assert "kvTransfer" not in observe(ready)


def test_an_aggregated_worker_has_no_prefill_status_nor_roles() -> None:
    observation = WorkerObservation(
        now=T0, deployment=deployment("llm"), pods=[pod("llm-a", None), pod("llm-b", None)]
    )
    status = compute_status(worker(), observation)
    assert "prefill" not in status
    assert all("role" not in p for p in status["pods"])
    assert condition(status, "Ready")[:2] == ("True", "AllReplicasReady")


def test_ready_prefill_pods_are_counted_before_holding_status_back() -> None:
    lagging = observe(deployment("llm-prefill", replicas=1, ready=1, updated=1))
    existing = copy.deepcopy(lagging)
    # Three ready pods: two decode pods and one prefill pod, as both Deployments count them.
    assert status_hold_seconds(existing, lagging, 0.0) == 0.0
    lagging["prefill"]["readyReplicas"] = 0
    assert status_hold_seconds(existing, lagging, 0.0) > 0.0


def test_a_lora_adapters_pod_entries_carry_the_pods_role() -> None:
    adapter = LoRAAdapter.model_validate(
        lora_adapter(spec={"workerRef": {"name": "llm"}})
        | {"metadata": {"name": "sql-adapter", "namespace": "ns", "uid": "a-1", "generation": 1}}
    )
    pods = [
        Pod("llm-a", "llm", "198.18.0.2", True, role=DECODE),
        Pod("llm-prefill-a", "llm", "198.18.0.3", True, role=PREFILL),
        Pod("other-a", "llm", "198.18.0.4", True),
    ]
    observation = AdapterObservation(now=T0, workers=(WorkerInfo("llm"),), pods=pods)
    status = LoRAAdapterStatus.model_validate(planner.plan(adapter, observation).status)
    assert {p.pod: p.role for p in status.pods} == {
        "llm-a": "decode",
        "llm-prefill-a": "prefill",
        "other-a": None,
    }
    summary = PodSummary.from_pod(
        {"metadata": {"name": "llm-prefill-a", "labels": {"dynamo.dev/role": "prefill"}}}
    )
    assert Pod.of(summary, "llm").role == "prefill"


def test_dropping_spec_prefill_deletes_the_prefill_children() -> None:
    fake = FakeCluster()
    settings = ReconcileSettings(vllm_worker_image="vllm:1", operator_namespace="ops")
    reconciler = WorkerReconciler(cast(Cluster, fake), settings)
    body = worker({"replicas": 1}).to_dict()
    body["metadata"] |= {"namespace": "ns", "uid": "u-1", "generation": 3}

    first = asyncio.run(reconciler.reconcile(body))
    prefill_children = {(kind, name) for kind, _, name in fake.objects if name == "llm-prefill"}
    assert prefill_children == {
        ("Deployment", "llm-prefill"),
        ("Service", "llm-prefill"),
        ("PodDisruptionBudget", "llm-prefill"),
        ("NetworkPolicy", "llm-prefill"),
        ("PodMonitor", "llm-prefill"),
    }
    assert first.status["prefill"] == {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}

    del body["spec"]["prefill"]
    body["status"] = first.status
    body["metadata"]["generation"] = 4
    second = asyncio.run(reconciler.reconcile(body))
    assert {name for _, _, name in fake.objects} == {"llm", "llm-worker"}
    assert sorted(fake.deleted) == sorted(prefill_children)
    assert "prefill" not in second.status
    # The decode role's children stay: the aggregated worker's names.
    assert ("Deployment", "ns", "llm") in fake.objects
