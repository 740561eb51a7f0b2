"""The operator on the test bed: `dynamo-operator run` in a subprocess against the real control
plane, worker pods on the fake GPU nodes.

- A DynamoWorker gets its Deployment, headless Service, PDB, ServiceAccount, Role and
  RoleBinding; its pods become Ready and so does the worker; the scale subresource scales it;
  a spec edit rolls the Deployment and Progressing reports it; pods' DynamoWorkerMetadata
  shows in status; a child deleted out of band comes back within the resync period; model
  taints that cannot reach a pod mark it Degraded; deleting the worker collects everything.
- A restarted operator makes no writes to converged children.
- Killed right after each of its writes while creating a worker, and restarted, the operator
  never leaves duplicate or orphaned children and converges.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.api.crd import dynamo_worker_metadata_crd
from dynamo_operator.k8s.client import CRASH_EXIT_CODE
from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from support.api_cases import dynamo_worker
from support.cluster import Cluster, eventually
from support.operator_process import (
    CHILD_KINDS,
    TEST_IMAGE,
    OperatorProcess,
    running_operator,
    start_operator,
)

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "dynamo.dev", "v1alpha1", "dynamoworkers"
RESYNC_SECONDS = 3.0
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


@pytest_asyncio.fixture(scope="session")
async def crds(api: client.ApiClient) -> AsyncIterator[None]:
    """The CRDs installed as the operator installs them (so its start writes none)."""
    await install_crds(OperatorCluster(api))
    yield


async def create_worker(
    api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: Any = dynamo_worker(name, {"replicas": 2, **(spec or {})})
    result: dict[str, Any] = await client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body
    )
    return result


async def get_worker(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    return result


def condition(worker: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (worker.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def is_ready(worker: dict[str, Any], replicas: int) -> bool:
    status = worker.get("status") or {}
    return (
        condition(worker, "Ready").get("status") == "True"
        and status.get("readyReplicas") == replicas
        and status.get("observedGeneration") == worker["metadata"]["generation"]
        and condition(worker, "Progressing").get("reason") == "RolloutComplete"
    )


async def wait_ready(
    api: client.ApiClient, namespace: str, name: str, replicas: int, within: float = 60
) -> dict[str, Any]:
    return await eventually(
        lambda: get_worker(api, namespace, name), within, lambda w: is_ready(w, replicas)
    )


async def children(api: client.ApiClient, namespace: str, worker: str) -> dict[str, list[Any]]:
    """Every child kind's objects labelled for `worker`."""
    selector = f"dynamo.dev/worker={worker}"
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    rbac, policy = client.RbacAuthorizationV1Api(api), client.PolicyV1Api(api)
    listings: tuple[Any, ...] = await asyncio.gather(
        apps.list_namespaced_deployment(namespace, label_selector=selector),
        core.list_namespaced_service(namespace, label_selector=selector),
        core.list_namespaced_service_account(namespace, label_selector=selector),
        rbac.list_namespaced_role(namespace, label_selector=selector),
        rbac.list_namespaced_role_binding(namespace, label_selector=selector),
        policy.list_namespaced_pod_disruption_budget(namespace, label_selector=selector),
    )
    kinds = ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PDB")
    return {kind: list(listing.items) for kind, listing in zip(kinds, listings, strict=True)}


def owned_by(obj: Any, uid: str) -> bool:
    refs = obj.metadata.owner_references or []
    return len(refs) == 1 and refs[0].uid == uid and refs[0].controller is True


async def pods(api: client.ApiClient, namespace: str, worker: str) -> list[Any]:
    listing = await client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"dynamo.dev/worker={worker}"
    )
    return [p for p in listing.items if p.metadata.deletion_timestamp is None]


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
        # The resume handler and at least one resync have run for every worker.
        await eventually(lambda: asyncio.to_thread(operator.reconciles), 30, lambda n: n >= 6)
        assert operator.requests() == 0, failure_context(operator)
        assert operator.requests(("get",), CHILD_KINDS) >= 3 * 6  # it did look
    after = {f"w{i}": await resource_versions(api, namespace, f"w{i}") for i in range(3)}
    assert after == before
    assert {f"w{i}": (await get_worker(api, namespace, f"w{i}"))["status"] for i in range(3)} == (
        statuses
    )


async def test_crash_after_every_write_never_duplicates_or_orphans(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    created = await create_worker(api, namespace, "crashy")
    uid = created["metadata"]["uid"]
    crashes = 0
    # Each run makes one write and dies at once, as if killed; the next run picks up there.
    while True:
        operator = start_operator(cluster, [namespace], log, crash_after_writes=1)
        try:
            done = await _crashed_or_idle(operator)
        finally:
            operator.stop()
        if not done:
            break
        crashes += 1
        assert crashes < 20, f"no convergence after {crashes} crashes:\n{operator.log_tail()}"
        # Whatever exists after a crash is exactly one of each kind, owned by the worker.
        for kind, objs in (await children(api, namespace, "crashy")).items():
            assert len(objs) <= 1, (kind, [o.metadata.name for o in objs])
            assert all(owned_by(o, uid) for o in objs), kind
    # Each of the six children and the status was written by a run that died right after.
    assert crashes >= 7, crashes
    with running_operator(cluster, [namespace], log):
        await wait_ready(api, namespace, "crashy", 2)
    found = await children(api, namespace, "crashy")
    assert {kind: len(objs) for kind, objs in found.items()} == dict.fromkeys(found, 1)
    assert all(owned_by(o, uid) for objs in found.values() for o in objs)
    replica_sets = await client.AppsV1Api(api).list_namespaced_replica_set(namespace)
    assert len(replica_sets.items) == 1
    assert len(await pods(api, namespace, "crashy")) == 2


async def _crashed_or_idle(operator: OperatorProcess) -> bool:
    """True when the operator crashed on purpose; False when it reconciled and stayed idle."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        code = operator.exited()
        if code is not None:
            assert code == CRASH_EXIT_CODE, f"exit {code}:\n{operator.log_tail()}"
            return True
        try:
            # The resume handler and two resyncs ran without a write: converged.
            if await asyncio.to_thread(operator.reconciles) >= 3:
                return operator.exited() is not None
        except OSError:
            pass  # not serving yet, or exiting
        await asyncio.sleep(0.1)
    raise AssertionError(f"neither crashed nor settled:\n{operator.log_tail()}")


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
