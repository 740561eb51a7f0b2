"""Convergence of many DynamoWorkers at once, against a floor measured in the same run.

Baseline: the same Deployments (as the builder renders them, without the operator) created
directly with the client, until every one has its pods Ready: the speed the API server,
scheduler and KWOK allow. Then the operator: as many DynamoWorkers created at once, until
every one reports Ready=True. Printed: both times and their ratio, the operator's API requests
per DynamoWorker (its own client's, counted by its metrics, plus kopf's patches of the
DynamoWorkers, counted by the API server's `apiserver_request_total`), and its RSS.

Pods request no GPU (the test bed has 32 fake GPUs), one replica each.
Run: `.venv/bin/pytest tests/bench/bench_operator.py -m bench -s` (set DYNAMO_BENCH_WORKERS to
change the count, or to a comma-separated list of counts, one run each; the test bed's fake
nodes hold 440 pods). After each run, a plot of convergence against the count, with the
floor, is rewritten with every count measured so far (tests/support/bench_plots.py).
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from dynamo_operator.api import DynamoWorker
from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from dynamo_operator.reconcile.dynamoworker.builders import desired_deployment
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from support import bench_plots
from support.api_cases import dynamo_worker
from support.cluster import Cluster
from support.operator_process import TEST_IMAGE, running_operator

pytestmark = [pytest.mark.bench, pytest.mark.cluster]

COUNTS = [int(n) for n in os.environ.get("DYNAMO_BENCH_WORKERS", "100").split(",")]
# (count, operator seconds, floor seconds) of every run so far, for the plot.
MEASURED: list[tuple[int, float, float]] = []
SPEC = {"replicas": 1, "resources": {"gpusPerPod": 0}}
POLL_SECONDS = 0.25
CREATE_CONCURRENCY = 50


@pytest_asyncio.fixture
async def fresh_namespace(api: client.ApiClient) -> AsyncIterator[str]:
    core = client.CoreV1Api(api)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    await core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
    for _ in range(100):
        try:
            await core.read_namespaced_service_account("default", name)
            break
        except client.ApiException:
            await asyncio.sleep(0.2)
    yield name
    await core.delete_namespace(name)


async def bounded(coros: list[Any]) -> None:
    limit = asyncio.Semaphore(CREATE_CONCURRENCY)

    async def one(coro: Any) -> None:
        async with limit:
            await coro

    await asyncio.gather(*(one(c) for c in coros))


def baseline_deployment(namespace: str, name: str) -> dict[str, Any]:
    body = dynamo_worker(name, SPEC)
    body["metadata"] |= {"namespace": namespace, "uid": str(uuid.uuid4()), "generation": 1}
    deployment = desired_deployment(
        DynamoWorker.model_validate(body), ReconcileSettings(worker_image=TEST_IMAGE)
    )
    deployment = copy.deepcopy(deployment)
    del deployment["metadata"]["ownerReferences"]
    # No per-worker ServiceAccount here: the floor is the Deployments alone.
    del deployment["spec"]["template"]["spec"]["serviceAccountName"]
    return deployment


async def until(probe: Any, within: float) -> float:
    started = time.monotonic()
    while not await probe():
        if time.monotonic() - started > within:
            raise AssertionError(f"not converged within {within}s")
        await asyncio.sleep(POLL_SECONDS)
    return time.monotonic() - started


async def apiserver_counts(api: client.ApiClient) -> dict[tuple[str, str, str], float]:
    """apiserver_request_total by (resource, subresource, verb)."""
    text = await api.call_api(
        "/metrics",
        "GET",
        auth_settings=["BearerToken"],
        response_types_map={200: "str"},
        _return_http_data_only=True,
    )
    counts: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(str(text)):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            key = (
                sample.labels.get("resource", ""),
                sample.labels.get("subresource", ""),
                sample.labels.get("verb", ""),
            )
            counts[key] = counts.get(key, 0.0) + sample.value
    return counts


@pytest.mark.parametrize("workers", COUNTS)
async def test_convergence_of_many_workers(
    api: client.ApiClient, cluster: Cluster, fresh_namespace: str, tmp_path: Path, workers: int
) -> None:
    await install_crds(OperatorCluster(api))
    apps = client.AppsV1Api(api)
    custom = client.CustomObjectsApi(api)
    names = [f"w{i:03d}" for i in range(workers)]

    # Baseline: the Deployments alone.
    base_ns = fresh_namespace
    started = time.monotonic()
    await bounded(
        [
            apps.create_namespaced_deployment(base_ns, baseline_deployment(base_ns, n))  # type: ignore[arg-type]
            for n in names
        ]
    )

    async def deployments_ready() -> bool:
        listing = await apps.list_namespaced_deployment(base_ns)
        ready = [d for d in listing.items if (d.status.ready_replicas or 0) >= 1]
        return len(ready) == workers

    await until(deployments_ready, 600)
    baseline = time.monotonic() - started
    await apps.delete_collection_namespaced_deployment(base_ns)

    # The operator, in a namespace of its own.
    core = client.CoreV1Api(api)
    op_ns = f"{base_ns}-op"
    await core.create_namespace({"metadata": {"name": op_ns}})  # type: ignore[arg-type]
    try:
        for _ in range(100):
            try:
                await core.read_namespaced_service_account("default", op_ns)
                break
            except client.ApiException:
                await asyncio.sleep(0.2)
        with running_operator(
            cluster, [op_ns], tmp_path / "operator.log", resync_seconds=30.0
        ) as operator:
            await operator.wait_serving()
            rss_idle = operator.rss_bytes()
            before = await apiserver_counts(api)
            started = time.monotonic()
            await bounded(
                [
                    custom.create_namespaced_custom_object(
                        "dynamo.dev", "v1alpha1", op_ns, "dynamoworkers", dynamo_worker(n, SPEC)
                    )
                    for n in names
                ]
            )

            async def workers_ready() -> bool:
                listing = await custom.list_namespaced_custom_object(
                    "dynamo.dev", "v1alpha1", op_ns, "dynamoworkers"
                )
                ready = [
                    w
                    for w in listing["items"]
                    if any(
                        c["type"] == "Ready" and c["status"] == "True"
                        for c in (w.get("status") or {}).get("conditions", [])
                    )
                ]
                return len(ready) == workers

            converged = await until(workers_ready, 900)
            after = await apiserver_counts(api)
            own = operator.requests(("get", "list", "apply", "delete", "patch-status", "create"))
            own_writes = operator.requests()
            breakdown = {
                f"{dict(labels)['verb']} {dict(labels)['kind']}": value
                for (metric, labels), value in operator.metrics().items()
                if metric == "dynamo_operator_api_requests_total"
            }
            reconciles = operator.reconciles()
            rss = operator.rss_bytes()
    finally:
        await core.delete_namespace(op_ns)

    kopf_patches = after.get(("dynamoworkers", "", "PATCH"), 0) - before.get(
        ("dynamoworkers", "", "PATCH"), 0
    )
    status_patches = after.get(("dynamoworkers", "status", "PATCH"), 0) - before.get(
        ("dynamoworkers", "status", "PATCH"), 0
    )
    print(
        f"\n{workers} DynamoWorkers (1 pod each): converged in {converged:.1f} s; "
        f"baseline (Deployments created directly) {baseline:.1f} s; "
        f"ratio {converged / baseline:.2f}"
    )
    print(
        f"API requests per DynamoWorker: {(own + kopf_patches) / workers:.1f} "
        f"(operator client {own / workers:.1f}, of which writes {own_writes / workers:.1f}; "
        f"kopf's PATCHes of the object {kopf_patches / workers:.1f}; "
        f"status PATCHes seen by the API server {status_patches / workers:.1f})"
    )
    print(
        f"reconciles per DynamoWorker: {reconciles / workers:.1f}; requests by verb and kind: "
        + ", ".join(f"{k} {v / workers:.1f}" for k, v in sorted(breakdown.items()))
    )
    print(
        f"operator RSS: {rss_idle / 2**20:.0f} MiB idle, {rss / 2**20:.0f} MiB with "
        f"{workers} DynamoWorkers"
    )
    MEASURED.append((workers, converged, baseline))
    bench_plots.convergence(MEASURED, "bench-operator-convergence")
