"""The hand-over to zero: the operator marks the activator's slice when spec.replicas is 0,
keeps the last pod until the activator's endpoint is ready, and lets it go then, or after
the bound with a Warning Event."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from dynamo_operator.api import DynamoWorker
from dynamo_operator.k8s.client import Cluster
from dynamo_operator.reconcile.dynamoworker import builders
from dynamo_operator.reconcile.dynamoworker.activator import (
    activator_ready,
    desired_activator_endpoint_slice,
)
from dynamo_operator.reconcile.dynamoworker.handover import (
    HAND_OVER_TIMEOUT_SECONDS,
    HandOver,
    hand_over,
)
from dynamo_operator.reconcile.dynamoworker.labels import SCALED_TO_ZERO_ANNOTATION
from dynamo_operator.reconcile.dynamoworker.reconciler import WorkerReconciler
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.dynamoworker.status import WorkerObservation, compute_status
from support.api_cases import dynamo_worker
from support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SETTINGS = ReconcileSettings(worker_image="dynamo-worker:test")
AUTOSCALING = {"minReplicas": 0, "maxReplicas": 2, "targetInFlightPerPod": 2}


def body(replicas: int, autoscaling: dict[str, Any] | None = AUTOSCALING) -> dict[str, Any]:
    spec: dict[str, Any] = {"replicas": replicas}
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    manifest = dynamo_worker("llm", spec)
    manifest["metadata"] |= {"namespace": "ns", "uid": "u-1", "generation": 3}
    return manifest


def worker(replicas: int, autoscaling: dict[str, Any] | None = AUTOSCALING) -> DynamoWorker:
    return DynamoWorker.model_validate(body(replicas, autoscaling))


def decide(
    desired: int = 0,
    *,
    has_activator: bool = True,
    deployment_replicas: int = 1,
    activator_ready: bool = False,
    waited_seconds: float = 0.0,
) -> HandOver:
    return hand_over(
        desired=desired,
        has_activator=has_activator,
        deployment_replicas=deployment_replicas,
        activator_ready=activator_ready,
        waited_seconds=waited_seconds,
    )


def test_the_last_pod_is_held_until_the_activator_is_ready() -> None:
    assert decide() is HandOver.WAITING
    assert decide(deployment_replicas=3) is HandOver.WAITING  # all but one go at once
    assert decide(waited_seconds=HAND_OVER_TIMEOUT_SECONDS - 1) is HandOver.WAITING


def test_the_last_pod_is_released_once_the_activator_is_ready() -> None:
    assert decide(activator_ready=True) is HandOver.DONE
    assert decide(activator_ready=True, waited_seconds=HAND_OVER_TIMEOUT_SECONDS) is HandOver.DONE


def test_the_last_pod_is_released_after_the_bound() -> None:
    assert decide(waited_seconds=HAND_OVER_TIMEOUT_SECONDS) is HandOver.TIMED_OUT


@pytest.mark.parametrize(
    "case",
    [
        {"desired": 1},  # pods are wanted
        {"has_activator": False},  # spec.replicas 0 without minReplicas 0: nothing stands in
        {"deployment_replicas": 0},  # the pods already go (or the worker is at zero)
    ],
)
def test_nothing_to_hand_over(case: dict[str, Any]) -> None:
    assert decide(**case) is HandOver.NONE


def test_the_activators_slice_is_marked_while_spec_replicas_is_zero() -> None:
    marked = desired_activator_endpoint_slice(worker(0))
    assert marked["metadata"]["annotations"] == {SCALED_TO_ZERO_ANNOTATION: "true"}
    assert "annotations" not in desired_activator_endpoint_slice(worker(1))["metadata"]


def test_the_deployment_keeps_one_pod_while_the_last_pod_is_held() -> None:
    def replicas(**kwargs: Any) -> int:
        deployments = [
            c
            for c in builders.desired_children(worker(0), SETTINGS, **kwargs)
            if c["kind"] == "Deployment" and c["metadata"]["name"] == "llm"
        ]
        return int(deployments[0]["spec"]["replicas"])

    assert replicas() == 0
    assert replicas(hold_last_pod=True) == 1


def test_activator_ready_reads_its_endpoints_ready_condition() -> None:
    assert not activator_ready(None)
    assert not activator_ready({"endpoints": []})
    assert not activator_ready({"endpoints": [{"conditions": {"ready": False}}]})
    assert activator_ready({"endpoints": [{"conditions": {"ready": True}}]})


def test_status_says_the_last_pod_serves_until_the_activator_stands_in() -> None:
    observed = WorkerObservation(now=T0, hand_over=HandOver.WAITING)
    status = compute_status(worker(0), observed)
    [progressing] = [c for c in status["conditions"] if c["type"] == "Progressing"]
    assert (progressing["status"], progressing["reason"]) == ("True", "HandingOverToActivator")
    assert f"at most {HAND_OVER_TIMEOUT_SECONDS:g} s" in progressing["message"]


class HandOverCluster(FakeCluster):
    """The fake API server, with what the activator does to it."""

    def replicas(self) -> int:
        return int(self.objects[("Deployment", "ns", "llm")]["spec"]["replicas"])

    def activator_steps_in(self) -> None:
        """What the activator's own apply does: its endpoint, ready."""
        endpoint = {"addresses": ["198.18.0.7"], "conditions": {"ready": True}}
        self.objects[("EndpointSlice", "ns", "llm-activator")]["endpoints"] = [endpoint]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def scaled_to_zero() -> tuple[HandOverCluster, Clock, WorkerReconciler]:
    """A worker that served with one pod, whose spec.replicas the autoscaler just set to 0."""
    fake, clock = HandOverCluster(has_crds=False), Clock()
    reconciler = WorkerReconciler(cast(Cluster, fake), SETTINGS, clock=clock)
    asyncio.run(reconciler.reconcile(body(1)))
    assert fake.replicas() == 1
    return fake, clock, reconciler


def test_the_reconciler_holds_the_last_pod_and_lets_it_go_once_the_activator_stands_in() -> None:
    fake, clock, reconciler = scaled_to_zero()
    held = asyncio.run(reconciler.reconcile(body(0)))
    assert fake.replicas() == 1
    annotations = fake.objects[("EndpointSlice", "ns", "llm-activator")]["metadata"]["annotations"]
    assert annotations[SCALED_TO_ZERO_ANNOTATION] == "true"  # the activator's cue
    assert held.wake_in_seconds == HAND_OVER_TIMEOUT_SECONDS  # it looks again at the bound
    [progressing] = [c for c in held.status["conditions"] if c["type"] == "Progressing"]
    assert progressing["reason"] == "HandingOverToActivator"

    clock.now += timedelta(seconds=2)
    fake.activator_steps_in()
    asyncio.run(reconciler.reconcile(body(0)))
    assert fake.replicas() == 0
    assert not [e for e in fake.events if e["type"] == "Warning"]


def test_the_reconciler_lets_the_last_pod_go_after_the_bound_with_a_warning() -> None:
    fake, clock, reconciler = scaled_to_zero()
    asyncio.run(reconciler.reconcile(body(0)))
    clock.now += timedelta(seconds=HAND_OVER_TIMEOUT_SECONDS - 5)
    waiting = asyncio.run(reconciler.reconcile(body(0)))
    assert fake.replicas() == 1
    assert waiting.wake_in_seconds == 5

    clock.now += timedelta(seconds=5)
    asyncio.run(reconciler.reconcile(body(0)))
    assert fake.replicas() == 0
    [warning] = [e for e in fake.events if e["type"] == "Warning"]
    assert warning["reason"] == "HandOverTimedOut"
    assert "llm-activator" in warning["note"]

    # At zero nothing is held again, and a later hand-over has a bound of its own.
    asyncio.run(reconciler.reconcile(body(0)))
    assert fake.replicas() == 0
    asyncio.run(reconciler.reconcile(body(1)))
    again = asyncio.run(reconciler.reconcile(body(0)))
    assert fake.replicas() == 1
    assert again.wake_in_seconds == HAND_OVER_TIMEOUT_SECONDS


def test_without_an_activator_spec_replicas_zero_is_zero_at_once() -> None:
    fake, clock = HandOverCluster(has_crds=False), Clock()
    reconciler = WorkerReconciler(cast(Cluster, fake), SETTINGS, clock=clock)
    asyncio.run(reconciler.reconcile(body(1, autoscaling=None)))
    asyncio.run(reconciler.reconcile(body(0, autoscaling=None)))
    assert fake.replicas() == 0
