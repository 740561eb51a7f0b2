"""The operator on the test bed: `dynamo-operator run` in a subprocess against the real control
plane, worker pods on the fake GPU nodes.

- A DynamoWorker gets its Deployment, headless Service, PDB, ServiceAccount, Role and
  RoleBinding; its pods become Ready and so does the worker; the scale subresource scales it;
  a spec edit rolls the Deployment and Progressing reports it; pods' DynamoWorkerMetadata
  shows in status; a child deleted out of band comes back within the resync period; model
  taints that cannot reach a pod mark it Degraded; deleting the worker collects everything.
- Children created and deleted out of band converge from the operator's watches alone (no
  resync, no read of a child from the API server): one of each, owned by the worker.
- A restarted operator makes no writes to converged children.
- The status writer knows the watch event of its own write (its echo), and times a held-back
  change.
- (Killed right after each of its writes: tests/cluster/test_faults.py.)
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.api.crd import dynamo_worker_metadata_crd
from dynamo_operator.api.dynamoworker import DynamoWorkerStatus
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from dynamo_operator.reconcile.status_writer import StatusWriter
from support.cluster import Cluster, eventually
from support.dynamo_workers import (
    GROUP,
    PLURAL,
    VERSION,
    children,
    condition,
    create_worker,
    get_worker,
    owned_by,
    pods,
    wait_ready,
)
from support.operator_process import (
    CHILD_KINDS,
    TEST_IMAGE,
    OperatorProcess,
    running_operator,
)

pytestmark = pytest.mark.cluster

RESYNC_SECONDS = 3.0
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


def failure_context(operator: OperatorProcess) -> str:
    return f"operator log:\n{operator.log_tail()}"


async def test_worker_lifecycle(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    custom = client.CustomObjectsApi(api)
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    with running_operator(cluster, [namespace], tmp_path / "operator.log") as operator:
        created = await create_worker(api, namespace, "llm")
        uid = created["metadata"]["uid"]
        try:
            worker = await wait_ready(api, namespace, "llm", 2)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{failure_context(operator)}") from None

        # One Event per occurrence: created (the rollout starts), then Ready (which also
        # completes the rollout: one Event naming both transitions).
        async def creation_events() -> list[tuple[str, str]]:
            listed = await client.EventsV1Api(api).list_namespaced_event(
                namespace, field_selector=f"regarding.uid={uid}"
            )
            ordered = sorted(listed.items, key=lambda e: e.event_time)
            return [(e.reason, e.note) for e in ordered]

        # kopf keeps only its finalizer on the object: no progress or diff-base annotation.
        assert worker["metadata"]["finalizers"] == ["dynamo.dev/finalizer"]
        annotations = worker["metadata"].get("annotations") or {}
        assert not [a for a in annotations if a.startswith("dynamo.dev/")], annotations

        news = await eventually(creation_events, 20, lambda got: len(got) >= 2)
        assert [reason for reason, _ in news] == ["RollingOut", "AllReplicasReady"], news
        assert "Progressing=False: all 2 pods run generation 1" in news[1][1], news

        # Children with the expected fields, each owned by the worker.
        found = await children(api, namespace, "llm")
        assert {kind: len(objs) for kind, objs in found.items()} == dict.fromkeys(found, 1)
        assert all(owned_by(obj, uid) for objs in found.values() for obj in objs)
        deployment = found["Deployment"][0]
        template = deployment.spec.template
        assert template.metadata.labels["nvidia.com/dynamo-discovery-enabled"] == "true"
        assert template.spec.service_account_name == "llm-worker"
        container = template.spec.containers[0]
        assert (container.name, container.image, container.command) == (
            "main",
            TEST_IMAGE,
            ["dynamo-worker"],
        )
        assert container.readiness_probe.http_get.path == "/health"
        assert template.spec.security_context.run_as_non_root is True
        service = found["Service"][0]
        assert service.spec.cluster_ip == "None"
        assert service.metadata.labels["nvidia.com/dynamo-discovery-backend"] == "kubernetes"
        assert found["PDB"][0].spec.max_unavailable == 1
        role = found["Role"][0]
        assert role.rules[0].resources == ["dynamoworkermetadatas"]
        assert found["RoleBinding"][0].subjects[0].name == "llm-worker"
        for pod in await pods(api, namespace, "llm"):
            assert pod.spec.node_name.startswith("kwok-gpu-"), pod.spec.node_name
        assert [p["name"] for p in worker["status"]["pods"]] == sorted(
            p.metadata.name for p in await pods(api, namespace, "llm")
        )
        assert worker["status"]["selector"] == "dynamo.dev/worker=llm"

        # A pod's DynamoWorkerMetadata (as the worker would write it) shows in status.
        first_pod = (await pods(api, namespace, "llm"))[0]
        await custom.create_namespaced_custom_object(
            "nvidia.com",
            "v1alpha1",
            namespace,
            "dynamoworkermetadatas",
            metadata_record(first_pod),
        )

        def shows_budget(w: dict[str, Any]) -> bool:
            entry = next(p for p in w["status"]["pods"] if p["name"] == first_pod.metadata.name)
            return entry.get("tokenBudget", {}).get("combinedLimit") == 2048

        worker = await eventually(lambda: get_worker(api, namespace, "llm"), 20, shows_budget)
        entry = next(p for p in worker["status"]["pods"] if p["name"] == first_pod.metadata.name)
        assert entry["taints"] == ["gpu=h100"]
        assert entry["dpRanks"] == [0]

        # Scale through the scale subresource (kubectl scale, an HPA).
        await custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, namespace, PLURAL, "llm", {"spec": {"replicas": 3}}, **MERGE_PATCH
        )
        await wait_ready(api, namespace, "llm", 3)
        scale = await custom.get_namespaced_custom_object_scale(
            GROUP, VERSION, namespace, PLURAL, "llm"
        )
        assert scale["status"] == {"replicas": 3, "selector": "dynamo.dev/worker=llm"}
        assert (await apps.read_namespaced_deployment("llm", namespace)).spec.replicas == 3

        # A spec edit rolls the Deployment; Progressing reports the rollout.
        old_pods = {p.metadata.name for p in await pods(api, namespace, "llm")}
        await custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "llm",
            {"spec": {"engine": {"extraArgs": ["--dtype", "bfloat16"]}}},
            **MERGE_PATCH,
        )
        worker = await wait_ready(api, namespace, "llm", 3)
        assert worker["metadata"]["generation"] == 3
        new_pods = {p.metadata.name for p in await pods(api, namespace, "llm")}
        assert len(new_pods) == 3
        assert not new_pods & old_pods
        deployment = await apps.read_namespaced_deployment("llm", namespace)
        assert deployment.spec.template.spec.containers[0].args[-2:] == ["--dtype", "bfloat16"]
        events = await client.EventsV1Api(api).list_namespaced_event(
            namespace, field_selector=f"regarding.uid={uid}"
        )
        reasons = [e.reason for e in events.items]
        assert "RollingOut" in reasons, reasons
        assert "RolloutComplete" in reasons, reasons

        # Children deleted out of band come back within the resync period.
        rbac = client.RbacAuthorizationV1Api(api)
        await rbac.delete_namespaced_role("llm-worker", namespace)
        await core.delete_namespaced_service("llm", namespace)
        started = time.monotonic()
        await eventually(
            lambda: rbac.read_namespaced_role("llm-worker", namespace), 3 * RESYNC_SECONDS
        )
        await eventually(lambda: core.read_namespaced_service("llm", namespace), 3 * RESYNC_SECONDS)
        assert time.monotonic() - started < 2 * RESYNC_SECONDS + 2

        # Model taints that cannot reach the (fake) pods: Degraded says so; clearing them heals.
        await custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "llm", {"spec": {"modelTaints": ["gpu=h100"]}},
            **MERGE_PATCH,
        )  # fmt: skip
        worker = await eventually(
            lambda: get_worker(api, namespace, "llm"),
            30,
            lambda w: condition(w, "Degraded").get("reason") == "TaintUpdateFailed",
        )
        assert "spec.modelTaints could not be applied" in condition(worker, "Degraded")["message"]
        await custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "llm", {"spec": {"modelTaints": None}},
            **MERGE_PATCH,
        )  # fmt: skip
        await eventually(
            lambda: get_worker(api, namespace, "llm"),
            30,
            lambda w: condition(w, "Degraded").get("status") == "False",
        )

        # The liveness endpoint reports on the watchers.
        status, _ = operator.health()
        assert status == 200

        # Deleting the worker collects every child (and the operator lets it go).
        await custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llm")

        async def all_gone() -> bool:
            left = await children(api, namespace, "llm")
            return not any(left.values()) and not await pods(api, namespace, "llm")

        await eventually(all_gone, 60, bool)
        with pytest.raises(ApiException) as gone:
            await get_worker(api, namespace, "llm")
        assert gone.value.status == 404


def metadata_record(pod: Any) -> dict[str, Any]:
    """A DynamoWorkerMetadata as a worker writes it: named after and owned by its pod."""
    card = {
        "type": "Model",
        "namespace": "ns-llm",
        "component": "worker",
        "endpoint": "generate",
        "instance_id": 42,
        "card_json": {
            "display_name": "Qwen/Qwen3-0.6B",
            "runtime_config": {
                "taints": ["gpu=h100"],
                "runtime_data": {"token_budget": {"combined_limit": 2048}},
            },
        },
    }
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoWorkerMetadata",
        "metadata": {
            "name": pod.metadata.name,
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod.metadata.name,
                    "uid": pod.metadata.uid,
                }
            ],
        },
        "spec": {"data": {"model_cards": {"ns-llm/worker/generate/2a": card}}},
    }


async def resource_versions(api: client.ApiClient, namespace: str, worker: str) -> dict[str, str]:
    found = await children(api, namespace, worker)
    return {
        f"{kind}/{obj.metadata.name}": obj.metadata.resource_version
        for kind, objs in found.items()
        for obj in objs
    }


async def test_children_changed_out_of_band_converge_from_the_watches(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    apps = client.AppsV1Api(api)
    # Before the worker: its ServiceAccount and Role exist already, made by someone else; the
    # Role carries the operator's managed-by label (so its watch reports it), the
    # ServiceAccount no label at all (so it does not).
    await core.create_namespaced_service_account(
        namespace,
        {"metadata": {"name": "oob-worker"}},  # type: ignore[arg-type]
    )
    managed = {"app.kubernetes.io/managed-by": "dynamo-operator"}
    await rbac.create_namespaced_role(
        namespace,
        {"metadata": {"name": "oob-worker", "labels": managed}, "rules": []},  # type: ignore[arg-type]
    )
    # A resync far away: whatever converges below converges from the watches.
    with running_operator(
        cluster, [namespace], tmp_path / "operator.log", resync_seconds=600
    ) as operator:
        created = await create_worker(api, namespace, "oob", {"replicas": 1})
        uid = created["metadata"]["uid"]
        await wait_ready(api, namespace, "oob", 1)
        found = await children(api, namespace, "oob")
        assert {kind: len(objs) for kind, objs in found.items()} == dict.fromkeys(found, 1)
        assert all(owned_by(o, uid) for objs in found.values() for o in objs)
        role = await rbac.read_namespaced_role("oob-worker", namespace)
        assert role.rules, "the operator's rules replaced the foreign Role's"

        # Deleted, and edited, out of band: back without any resync.
        await rbac.delete_namespaced_role("oob-worker", namespace)
        await core.delete_namespaced_service("oob", namespace)
        await apps.patch_namespaced_deployment(
            "oob", namespace, {"spec": {"replicas": 3}}, **MERGE_PATCH
        )
        await eventually(lambda: rbac.read_namespaced_role("oob-worker", namespace), 20)
        await eventually(lambda: core.read_namespaced_service("oob", namespace), 20)
        await eventually(
            lambda: apps.read_namespaced_deployment("oob", namespace),
            20,
            lambda d: d.spec.replicas == 1,
        )
        found = await children(api, namespace, "oob")
        assert {kind: len(objs) for kind, objs in found.items()} == dict.fromkeys(found, 1)
        assert all(owned_by(o, uid) for objs in found.values() for o in objs)
        await wait_ready(api, namespace, "oob", 1)
        # Every read of a child came from the watches.
        assert operator.requests(("get",), CHILD_KINDS) == 0, failure_context(operator)


async def test_restart_on_converged_workers_writes_nothing(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    with running_operator(cluster, [namespace], log):
        await asyncio.gather(*(create_worker(api, namespace, f"w{i}") for i in range(3)))
        for i in range(3):
            await wait_ready(api, namespace, f"w{i}", 2)
    before = {f"w{i}": await resource_versions(api, namespace, f"w{i}") for i in range(3)}
    statuses = {f"w{i}": (await get_worker(api, namespace, f"w{i}"))["status"] for i in range(3)}

    with running_operator(cluster, [namespace], log) as operator:
        await operator.wait_serving()
        # Every worker's daemon has made its first pass, and at least one resync has run.
        await eventually(lambda: asyncio.to_thread(operator.reconciles), 30, lambda n: n >= 6)
        assert operator.requests() == 0, failure_context(operator)
        # It looked at every child, in the memory its watches fill.
        assert operator.requests(("get",), CHILD_KINDS) == 0, failure_context(operator)
    after = {f"w{i}": await resource_versions(api, namespace, f"w{i}") for i in range(3)}
    assert after == before
    assert {f"w{i}": (await get_worker(api, namespace, f"w{i}"))["status"] for i in range(3)} == (
        statuses
    )


async def test_upstream_metadata_crd_is_left_alone(
    api: client.ApiClient, cluster: Cluster, crds: None
) -> None:
    """Installed only when absent: an existing copy (perhaps upstream's own) is not rewritten."""
    ext = client.ApiextensionsV1Api(api)
    name = dynamo_worker_metadata_crd()["metadata"]["name"]
    before = (await ext.read_custom_resource_definition(name)).metadata.resource_version
    cluster_client = OperatorCluster(api)
    assert await install_crds(cluster_client) == []
    assert cluster_client.writes == 0
    after = (await ext.read_custom_resource_definition(name)).metadata.resource_version
    assert after == before


async def test_status_writer_knows_its_own_echo(
    api: client.ApiClient, namespace: str, crds: None
) -> None:
    now = [100.0]
    writer = StatusWriter(
        OperatorCluster(api), kinds.DYNAMO_WORKER, DynamoWorkerStatus, monotonic=lambda: now[0]
    )
    created = await create_worker(api, namespace, "echo")
    assert not writer.is_echo(created["metadata"])
    # A held-back change is timed from its first hold until the next write.
    assert writer.held(created["metadata"]) == 0
    writer.hold(created["metadata"])
    now[0] += 0.25
    writer.hold(created["metadata"])
    now[0] += 0.25
    assert writer.held(created["metadata"]) == 0.5
    existing = writer.normalized(created.get("status"))
    assert await writer.write(created["metadata"], existing, {**existing, "replicas": 2})
    assert writer.held(created["metadata"]) == 0
    # What the watch (here, a read) then delivers is our write: no reconcile needed.
    after_write = await get_worker(api, namespace, "echo")
    assert after_write["status"]["replicas"] == 2
    assert writer.is_echo(after_write["metadata"])
    # Anyone else's change (a label here) is not.
    await client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "echo", {"metadata": {"labels": {"team": "a"}}},
        **MERGE_PATCH,
    )  # fmt: skip
    assert not writer.is_echo((await get_worker(api, namespace, "echo"))["metadata"])
    writer.forget(created["metadata"]["uid"])
    assert not writer.is_echo(after_write["metadata"])
