"""A DynamoWorker's PodMonitor (spec.metrics.podMonitor) against the real API server.

- Without the Prometheus Operator's PodMonitor CRD: `Auto` puts prometheus.io annotations on
  the pod template and makes no PodMonitor; `Enabled` marks the worker Degraded with
  `PodMonitorUnavailable`, naming the fix.
- With the CRD (a stand-in, tests/cluster/data/): `Auto` makes a PodMonitor named like the
  worker, owned by it, selecting its pods' labels on their `system` port at `/metrics`, and no
  annotations; resyncs leave it unwritten; `Disabled` deletes it; `Enabled` brings it back;
  deleting the worker lets the garbage collector take it.

The operator checks for the CRD at its first reconcile and then at most once a minute (one
request however many reconciles run at that moment), so each scenario starts its operator
after the CRD is installed (or removed); the transition while an operator runs is left to the
unit tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from dynamo_operator.reconcile.dynamoworker.builders import POD_MONITOR_CRD
from dynamo_operator.reconcile.dynamoworker.reconciler import WorkerReconciler
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from support.api_cases import dynamo_worker
from support.cluster import Cluster, ensure_crd, eventually
from support.operator_process import OperatorProcess, running_operator

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "dynamo.dev", "v1alpha1", "dynamoworkers"
PM_GROUP, PM_VERSION, PM_PLURAL = "monitoring.coreos.com", "v1", "podmonitors"
CRD_FILE = Path(__file__).parent / "data" / "podmonitors.monitoring.coreos.com.yaml"
# The stand-in CRD carries this label; teardown deletes only a CRD that has it.
TEST_LABEL = "dynamo.dev/test"
SCRAPE_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


@pytest_asyncio.fixture(scope="session")
async def operator_crds(api: client.ApiClient) -> AsyncIterator[None]:
    """The operator's CRDs installed as the operator installs them (its start writes none)."""
    await install_crds(OperatorCluster(api))
    yield


async def _read_crd(api: client.ApiClient) -> Any | None:
    try:
        return await client.ApiextensionsV1Api(api).read_custom_resource_definition(POD_MONITOR_CRD)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _ours(crd: Any) -> bool:
    return (crd.metadata.labels or {}).get(TEST_LABEL) == "true"


async def _delete_our_crd(api: client.ApiClient) -> None:
    """Delete the stand-in CRD (if it is there) and wait until the API server has removed it
    and every PodMonitor with it, so that later tests see a cluster without the kind."""
    crd = await _read_crd(api)
    if crd is None:
        return
    assert _ours(crd), f"refusing to delete {POD_MONITOR_CRD}: it lacks the {TEST_LABEL} label"
    try:
        await client.ApiextensionsV1Api(api).delete_custom_resource_definition(POD_MONITOR_CRD)
    except ApiException as exc:
        if exc.status != 404:
            raise
    await eventually(lambda: _read_crd(api), 60, lambda got: got is None)


@pytest_asyncio.fixture
async def without_pod_monitor_crd(api: client.ApiClient) -> None:
    """A cluster without the PodMonitor kind (a stand-in left by an interrupted run is
    removed; a real Prometheus Operator's is not, and the test skips)."""
    crd = await _read_crd(api)
    if crd is not None and not _ours(crd):
        pytest.skip(f"the cluster has its own {POD_MONITOR_CRD} (a Prometheus Operator?)")
    await _delete_our_crd(api)


@pytest_asyncio.fixture
async def with_pod_monitor_crd(api: client.ApiClient) -> AsyncIterator[None]:
    """The stand-in PodMonitor CRD, Established, for one test; deleted (and awaited gone)
    afterwards whatever happens. A CRD the cluster already had (not ours) is used as is and
    left alone."""
    crd = await _read_crd(api)
    if crd is not None and not _ours(crd):
        yield
        return
    try:
        await _delete_our_crd(api)  # a copy left by an interrupted run may be terminating
        await ensure_crd(api, CRD_FILE)
        yield
    finally:
        await _delete_our_crd(api)


async def create_worker(
    api: client.ApiClient, namespace: str, name: str, mode: str | None = None
) -> dict[str, Any]:
    """A one-replica DynamoWorker; `mode` sets spec.metrics.podMonitor (None: the default)."""
    spec: dict[str, Any] = {"replicas": 1}
    if mode is not None:
        spec["metrics"] = {"podMonitor": mode}
    body: Any = dynamo_worker(name, spec)
    result: dict[str, Any] = await client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body
    )
    return result


async def get_worker(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    return result


async def set_mode(api: client.ApiClient, namespace: str, name: str, mode: str) -> None:
    await client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": {"metrics": {"podMonitor": mode}}},
        **MERGE_PATCH,
    )  # fmt: skip


def condition(worker: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (worker.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def settled(worker: dict[str, Any]) -> bool:
    """Ready, with a status computed from the current generation."""
    status = worker.get("status") or {}
    return (
        condition(worker, "Ready").get("status") == "True"
        and status.get("observedGeneration") == worker["metadata"]["generation"]
    )


async def wait_settled(
    api: client.ApiClient, namespace: str, name: str, operator: OperatorProcess
) -> dict[str, Any]:
    try:
        return await eventually(lambda: get_worker(api, namespace, name), 60, settled)
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{operator.log_tail()}") from None


async def get_pod_monitor(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        PM_GROUP, PM_VERSION, namespace, PM_PLURAL, name
    )
    return result


async def pod_monitor_gone(api: client.ApiClient, namespace: str, name: str) -> bool:
    try:
        await get_pod_monitor(api, namespace, name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


async def pod_template(api: client.ApiClient, namespace: str, name: str) -> Any:
    deployment = await client.AppsV1Api(api).read_namespaced_deployment(name, namespace)
    return deployment.spec.template


def system_port(template: Any) -> int:
    """The container port named `system` (what a PodMonitor's endpoint refers to)."""
    ports = [p for c in template.spec.containers for p in c.ports or [] if p.name == "system"]
    assert len(ports) == 1, [c.ports for c in template.spec.containers]
    return int(ports[0].container_port)


async def assert_pod_monitor_for(
    api: client.ApiClient, namespace: str, worker: dict[str, Any]
) -> None:
    """The worker's PodMonitor: named like it, controlled by it, scraping its pods' `system`
    port at /metrics."""
    name, uid = worker["metadata"]["name"], worker["metadata"]["uid"]
    monitor = await get_pod_monitor(api, namespace, name)
    refs = monitor["metadata"].get("ownerReferences") or []
    assert [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in refs] == [
        ("DynamoWorker", name, uid, True)
    ], refs
    match_labels = monitor["spec"]["selector"]["matchLabels"]
    deployment = await client.AppsV1Api(api).read_namespaced_deployment(name, namespace)
    assert match_labels == deployment.spec.selector.match_labels
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "system", "path": "/metrics"}]
    # It selects exactly the worker's (ready) pods, and each has the port it names.
    selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
    selected = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector)
    live = sorted(p.metadata.name for p in selected.items if p.metadata.deletion_timestamp is None)
    assert live == [p["name"] for p in worker["status"]["pods"]]
    for pod in selected.items:
        system_port(pod)


async def test_without_the_crd_auto_annotates_and_enabled_degrades(
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    operator_crds: None,
    without_pod_monitor_crd: None,
    tmp_path: Path,
) -> None:
    with running_operator(cluster, [namespace], tmp_path / "operator.log") as operator:
        await asyncio.gather(
            create_worker(api, namespace, "auto"),  # the default mode
            create_worker(api, namespace, "enabled", "Enabled"),
        )
        auto = await wait_settled(api, namespace, "auto", operator)
        enabled = await wait_settled(api, namespace, "enabled", operator)

        # Auto: scrape annotations pointing at the system port, and nothing to complain about.
        template = await pod_template(api, namespace, "auto")
        annotations = template.metadata.annotations or {}
        assert {k: annotations.get(k) for k in SCRAPE_ANNOTATIONS} == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(system_port(template)),
            "prometheus.io/path": "/metrics",
        }
        assert condition(auto, "Degraded")["status"] == "False", condition(auto, "Degraded")

        # Enabled: no annotations (a PodMonitor was asked for), and Degraded names the fix.
        template = await pod_template(api, namespace, "enabled")
        assert not set(SCRAPE_ANNOTATIONS) & set(template.metadata.annotations or {})
        degraded = condition(enabled, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "PodMonitorUnavailable")
        assert "spec.metrics.podMonitor is Enabled" in degraded["message"]
        assert "install the Prometheus Operator or set podMonitor to Auto" in degraded["message"]

        # Without the kind the operator never even looks for a PodMonitor.
        verbs = ("get", "list", "apply", "delete")
        assert operator.requests(verbs, ("PodMonitor",)) == 0, operator.log_tail()


async def test_with_the_crd_pod_monitor_follows_the_mode(
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    operator_crds: None,
    with_pod_monitor_crd: None,
    tmp_path: Path,
) -> None:
    custom = client.CustomObjectsApi(api)
    # Started after the CRD exists: its first reconcile finds the kind.
    with running_operator(cluster, [namespace], tmp_path / "operator.log") as operator:
        await create_worker(api, namespace, "llm")  # Auto, the default
        worker = await wait_settled(api, namespace, "llm", operator)
        await eventually(lambda: get_pod_monitor(api, namespace, "llm"), 30)
        await assert_pod_monitor_for(api, namespace, worker)
        template = await pod_template(api, namespace, "llm")
        assert not set(SCRAPE_ANNOTATIONS) & set(template.metadata.annotations or {})
        assert condition(worker, "Degraded")["status"] == "False", condition(worker, "Degraded")

        # Converged: later resyncs read the PodMonitor from the watch-fed index (the CRD
        # existed at startup), so they neither GET it nor write anything at all.
        writes = await asyncio.to_thread(operator.requests)
        looks = await asyncio.to_thread(operator.requests, ("get",), ("PodMonitor",))
        passes = await asyncio.to_thread(operator.reconciles)
        await eventually(
            lambda: asyncio.to_thread(operator.reconciles), 30, lambda n: n >= passes + 2
        )
        assert await asyncio.to_thread(operator.requests) == writes, operator.log_tail()
        assert await asyncio.to_thread(operator.requests, ("get",), ("PodMonitor",)) == looks

        # Disabled: the operator deletes it (the worker still exists, so not the collector).
        monitor_uid = (await get_pod_monitor(api, namespace, "llm"))["metadata"]["uid"]
        await set_mode(api, namespace, "llm", "Disabled")
        await eventually(lambda: pod_monitor_gone(api, namespace, "llm"), 30, bool)
        worker = await wait_settled(api, namespace, "llm", operator)
        assert operator.requests(("delete",), ("PodMonitor",)) == 1
        template = await pod_template(api, namespace, "llm")
        assert not set(SCRAPE_ANNOTATIONS) & set(template.metadata.annotations or {})

        # Enabled: a new one, the same as before.
        await set_mode(api, namespace, "llm", "Enabled")
        monitor = await eventually(lambda: get_pod_monitor(api, namespace, "llm"), 30)
        assert monitor["metadata"]["uid"] != monitor_uid
        worker = await wait_settled(api, namespace, "llm", operator)
        await assert_pod_monitor_for(api, namespace, worker)
        assert condition(worker, "Degraded")["status"] == "False", condition(worker, "Degraded")

        # Deleting the worker: the garbage collector takes the PodMonitor with it.
        await custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llm")
        await eventually(lambda: pod_monitor_gone(api, namespace, "llm"), 60, bool)
        assert operator.requests(("delete",), ("PodMonitor",)) == 1


async def test_reconciles_at_once_check_for_the_crd_once(api: client.ApiClient) -> None:
    cluster = OperatorCluster(api)
    reconciler = WorkerReconciler(cluster, ReconcileSettings(worker_image="w:1"))
    await asyncio.gather(*(reconciler.refresh_cluster_facts() for _ in range(16)))
    assert cluster.requests[("get", "CustomResourceDefinition")] == 1
    await reconciler.refresh_cluster_facts()  # not due again for a minute
    assert cluster.requests[("get", "CustomResourceDefinition")] == 1
