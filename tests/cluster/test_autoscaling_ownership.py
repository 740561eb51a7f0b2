"""Who owns spec.replicas, against the real API server, with the operator as a process and
pods on the fake nodes (they run nothing: no pod's load can be read, so the autoscaler sees
none).

- Without spec.autoscaling the count is the user's: `/scale` (what kubectl scale, an HPA and a
  KEDA ScaledObject write) reaches the Deployment, and the operator never writes it back.
- With spec.autoscaling the autoscaler owns it: a count outside the bounds is brought back,
  with status.autoscaling's last decision, an Event, and printer columns that show them.
- minReplicas 0 gives the worker an activator (Deployment, EndpointSlice joining the worker
  Service, its own Role); dropping it removes them again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.reconcile.dynamoworker.labels import activator_name
from support.cluster import Cluster, eventually
from support.dynamo_workers import GROUP, PLURAL, VERSION, create_worker, get_worker
from support.operator_process import running_operator, start_operator

pytestmark = pytest.mark.cluster

MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
SPEC = {"model": {"name": "tiny", "source": "s3://models/tiny"}}


async def _deployment_replicas(api: client.ApiClient, namespace: str, name: str) -> int | None:
    try:
        deployment = await client.AppsV1Api(api).read_namespaced_deployment(name, namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return int(deployment.spec.replicas)


async def _scale(api: client.ApiClient, namespace: str, name: str, replicas: int) -> None:
    await client.CustomObjectsApi(api).patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}}, **MERGE_PATCH
    )


async def _events(api: client.ApiClient, namespace: str, name: str) -> list[Any]:
    # The core view: kopf's own Events have no eventTime, which the events.k8s.io client refuses.
    listed = await client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    )
    return list(listed.items)


async def test_replicas_stay_the_users_without_autoscaling(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    with running_operator(cluster, [namespace], tmp_path / "operator.log"):
        await create_worker(api, namespace, "manual", {**SPEC, "replicas": 1})
        await eventually(lambda: _deployment_replicas(api, namespace, "manual"), 60, (1).__eq__)
        await _scale(api, namespace, "manual", 3)
        await eventually(lambda: _deployment_replicas(api, namespace, "manual"), 60, (3).__eq__)
        # Once the operator has reconciled the new count, the user's count still stands and
        # nothing was scaled.
        worker = await eventually(
            lambda: get_worker(api, namespace, "manual"),
            60,
            lambda w: (
                (w.get("status") or {}).get("observedGeneration") == w["metadata"]["generation"]
            ),
        )
        assert worker["spec"]["replicas"] == 3
        assert "autoscaling" not in worker["status"]
        reasons = {e.reason for e in await _events(api, namespace, "manual")}
        assert not reasons & {"ScaledUp", "ScaledDown", "ScaledToBounds", "ScaledToZero"}


async def test_the_autoscaler_owns_replicas_and_explains_itself(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    autoscaling = {"minReplicas": 2, "maxReplicas": 3, "targetInFlightPerPod": 4}
    with running_operator(cluster, [namespace], tmp_path / "operator.log"):
        await create_worker(
            api, namespace, "auto", {**SPEC, "replicas": 7, "autoscaling": autoscaling}
        )
        # 7 is above maxReplicas: brought to 3 at once; then, with no load, the scale-down
        # window (300 s by default) keeps it there.
        worker = await eventually(
            lambda: get_worker(api, namespace, "auto"),
            60,
            lambda w: "lastDecision" in ((w.get("status") or {}).get("autoscaling") or {}),
        )
        decision = worker["status"]["autoscaling"]["lastDecision"]
        assert (decision["fromReplicas"], decision["toReplicas"]) == (7, 3), decision
        assert decision["direction"] == "Bounds"
        assert "outside [2, 3]" in decision["reason"]
        assert worker["spec"]["replicas"] == 3
        await eventually(lambda: _deployment_replicas(api, namespace, "auto"), 60, (3).__eq__)
        events = await _events(api, namespace, "auto")
        assert any(e.reason == "ScaledToBounds" and "7 -> 3" in e.message for e in events)

        # kubectl scale on an autoscaled worker: the autoscaler takes the count back.
        await _scale(api, namespace, "auto", 1)
        await eventually(
            lambda: get_worker(api, namespace, "auto"), 60, lambda w: w["spec"]["replicas"] == 2
        )


async def test_scale_to_zero_brings_an_activator_and_takes_it_away(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    apps, discovery = client.AppsV1Api(api), client.DiscoveryV1Api(api)
    name = activator_name("zero")
    autoscaling = {"minReplicas": 0, "maxReplicas": 2, "targetInFlightPerPod": 4}
    with running_operator(cluster, [namespace], tmp_path / "operator.log"):
        await create_worker(api, namespace, "zero", {**SPEC, "autoscaling": autoscaling})

        async def activator_deployment() -> Any:
            try:
                return await apps.read_namespaced_deployment(name, namespace)
            except ApiException as err:
                if err.status == 404:
                    return None
                raise

        deployment = await eventually(activator_deployment, 60, bool)
        (container,) = deployment.spec.template.spec.containers
        assert container.command == ["dynamo-activator"]
        assert "dynamo.dev/worker" not in deployment.spec.template.metadata.labels
        slice_ = await discovery.read_namespaced_endpoint_slice(name, namespace)
        assert slice_.metadata.labels["kubernetes.io/service-name"] == "zero"
        assert slice_.metadata.labels["endpointslice.kubernetes.io/managed-by"] == (
            "dynamo-activator"
        )
        assert not slice_.endpoints
        role = await client.RbacAuthorizationV1Api(api).read_namespaced_role(name, namespace)
        own = [r for r in role.rules if r.resource_names]
        assert [(r.resources, r.resource_names, r.verbs) for r in own] == [
            (["endpointslices"], [name], ["get", "patch"])
        ]
        # No pod ever served: the activator has no card, so the worker is never put to zero
        # (and the scale-down window keeps the 2 it was made with).
        worker = await eventually(
            lambda: get_worker(api, namespace, "zero"),
            30,
            lambda w: "autoscaling" in (w.get("status") or {}),
        )
        assert worker["status"]["autoscaling"]["desiredReplicas"] == 2
        assert worker["spec"]["replicas"] == 2

        await client.CustomObjectsApi(api).patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "zero",
            {"spec": {"autoscaling": {"minReplicas": 1}}},
            **MERGE_PATCH,
        )
        await eventually(activator_deployment, 60, lambda d: d is None)


async def test_a_new_operator_carries_on_after_one_killed_mid_scale(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    """The first operator is killed (SIGKILL: no cleanup) as soon as it has written the new
    count; the next one keeps that count (no reset, no early scale-down: the scale-down
    window counts on) and reports it."""
    autoscaling = {"minReplicas": 2, "maxReplicas": 3, "targetInFlightPerPod": 4}
    first = start_operator(cluster, [namespace], tmp_path / "first.log")
    try:
        await create_worker(
            api, namespace, "handover", {**SPEC, "replicas": 7, "autoscaling": autoscaling}
        )
        await eventually(
            lambda: get_worker(api, namespace, "handover"),
            60,
            lambda w: w["spec"]["replicas"] == 3,
        )
    finally:
        first.process.kill()
        first.process.wait(10)
    with running_operator(cluster, [namespace], tmp_path / "second.log") as second:
        worker = await eventually(
            lambda: get_worker(api, namespace, "handover"),
            60,
            lambda w: (
                ((w.get("status") or {}).get("autoscaling") or {}).get("desiredReplicas") == 3
                and (w.get("status") or {}).get("observedGeneration") == w["metadata"]["generation"]
            ),
        )
        await eventually(lambda: _deployment_replicas(api, namespace, "handover"), 60, (3).__eq__)

        # Its own reads decide 3 too (the load, none, asks for 2; the window holds).
        def desired() -> float | None:
            key = (
                "dynamo_operator_autoscaler_desired_replicas",
                (("name", "handover"), ("namespace", namespace)),
            )
            return second.metrics().get(key)

        assert await eventually(lambda: asyncio.sleep(0, desired()), 30, bool) == 3
        worker = await get_worker(api, namespace, "handover")
        assert worker["spec"]["replicas"] == 3
