"""Convergence of many DynamoWorkers at once, against a floor measured in the same run.

Baseline: the same Deployments (as the builder renders them, without the operator) created
directly with the client, until every one has its pods Ready: the speed the API server,
scheduler and KWOK allow. Then the operator: as many DynamoWorkers created at once, until
every one reports Ready=True. Printed: both times and their ratio, the operator's API requests
per DynamoWorker (its own client's, counted by its metrics, plus kopf's patches of the
DynamoWorkers, counted by the API server's `apiserver_request_total`), and its RSS.

Then, converged, an idle window (DYNAMO_BENCH_IDLE_SECONDS, default 60; 0 skips it): what
the operator sends while nothing changes (its children are read from its watches, so no
child reads; resyncs included). Printed per count: the ratio to the floor, API requests by
verb per DynamoWorker, reconciles per DynamoWorker, RSS, and the issue's goals beside them
(printed, not asserted).

With DYNAMO_BENCH_LORA_ADAPTERS=N (e.g. 500), N LoRAAdapters are then created over those workers
(round robin) and timed until each has settled its status; the workers leave LoRA disabled
(their fake pods serve nothing), so this measures what N more objects cost the operator
(requests, reconciles, RSS), not adapter loads (tests/bench/bench_lora_adapter.py does those).

Pods request no GPU (the test bed has 32 fake GPUs), one replica each.
Run: `.venv/bin/pytest tests/bench/bench_operator.py -m bench -s` (set DYNAMO_BENCH_WORKERS to
change the count, or to a comma-separated list of counts, one run each, e.g. 100,400,1000;
the fake nodes hold 110 pods each, and are given room for more for the run when a count
needs it). After each run, a plot of convergence against the count, with the floor, is
rewritten with every count measured so far (tests/support/bench_plots.py).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from support.api_cases import dynamo_worker, lora_adapter
from support.cluster import Cluster
from support.operator_process import CHILD_KINDS, TEST_IMAGE, OperatorProcess, running_operator

pytestmark = [pytest.mark.bench, pytest.mark.cluster]

COUNTS = [int(n) for n in os.environ.get("DYNAMO_BENCH_WORKERS", "100").split(",")]
IDLE_SECONDS = float(os.environ.get("DYNAMO_BENCH_IDLE_SECONDS", "60"))
ADAPTERS = int(os.environ.get("DYNAMO_BENCH_LORA_ADAPTERS", "0"))
FAKE_NODES = [f"kwok-gpu-{i}" for i in range(4)]
NODE_PODS = 110  # what the test bed gives each fake node
# The issue's goals (printed beside the figures).
GOAL_RATIO = {400: 1.2, 1000: 1.3}
GOAL_REQUESTS, GOAL_WRITES = 12, 8
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


@contextlib.asynccontextmanager
async def pod_room(api: client.ApiClient, pods: int) -> AsyncIterator[None]:
    """Fake nodes with room for `pods` more pods (plus headroom) for the block."""
    core = client.CoreV1Api(api)
    per_node = max(NODE_PODS, -(-int(pods * 1.1) // len(FAKE_NODES)) + 10)

    async def set_pods(count: int) -> None:
        room = {"status": {"capacity": {"pods": str(count)}, "allocatable": {"pods": str(count)}}}
        for node in FAKE_NODES:
            await core.patch_node_status(node, room)

    if per_node > NODE_PODS:
        await set_pods(per_node)
    try:
        yield
    finally:
        if per_node > NODE_PODS:
            await set_pods(NODE_PODS)


def requests_by_verb_and_kind(operator: OperatorProcess) -> dict[str, float]:
    """The operator client's requests so far, by "verb Kind"."""
    return {
        f"{dict(labels)['verb']} {dict(labels)['kind']}": value
        for (metric, labels), value in operator.metrics().items()
        if metric == "dynamo_operator_api_requests_total"
    }


def settled(adapter: dict[str, Any]) -> bool:
    status = adapter.get("status") or {}
    generation = adapter["metadata"].get("generation")
    ready = [c for c in status.get("conditions") or [] if c["type"] == "Ready"]
    return bool(ready) and status.get("observedGeneration") == generation


async def adapters_settle(
    api: client.ApiClient, operator: OperatorProcess, namespace: str, workers: list[str]
) -> None:
    """Create ADAPTERS LoRAAdapters over `workers` and print what settling them cost."""
    custom = client.CustomObjectsApi(api)
    before = requests_by_verb_and_kind(operator)
    reconciles_key = (
        "dynamo_operator_reconcile_duration_seconds_count",
        (("kind", "LoRAAdapter"),),
    )
    reconciles = operator.metrics().get(reconciles_key, 0.0)
    started = time.monotonic()
    await bounded(
        [
            custom.create_namespaced_custom_object(
                "dynamo.dev",
                "v1alpha1",
                namespace,
                "loraadapters",
                lora_adapter(f"a{i:04d}", {"workerRef": {"name": workers[i % len(workers)]}}),
            )
            for i in range(ADAPTERS)
        ]
    )

    async def all_settled() -> bool:
        listing = await custom.list_namespaced_custom_object(
            "dynamo.dev", "v1alpha1", namespace, "loraadapters"
        )
        return sum(1 for a in listing["items"] if settled(a)) == ADAPTERS

    await until(all_settled, 900)
    took = time.monotonic() - started
    after = requests_by_verb_and_kind(operator)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    print(
        f"{ADAPTERS} LoRAAdapters over {len(workers)} DynamoWorkers: settled in {took:.1f} s; "
        f"API requests per adapter {sum(delta.values()) / ADAPTERS:.1f} "
        f"({by_verb(delta, ADAPTERS)}); reconciles per adapter "
        f"{(operator.metrics().get(reconciles_key, 0.0) - reconciles) / ADAPTERS:.1f}; "
        f"operator RSS {operator.rss_bytes() / 2**20:.0f} MiB (goal <= 200 at 500 + 500)"
    )


def by_verb(breakdown: dict[str, float], workers: int) -> str:
    verbs: dict[str, float] = {}
    for what, value in breakdown.items():
        verb = what.split(" ", 1)[0]
        verbs[verb] = verbs.get(verb, 0.0) + value
    return ", ".join(f"{verb} {n / workers:.1f}" for verb, n in sorted(verbs.items()))


def child_reads(breakdown: dict[str, float]) -> float:
    return sum(
        v
        for k, v in breakdown.items()
        if k.split(" ")[0] == "get" and k.split(" ")[1] in CHILD_KINDS
    )


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
    async with pod_room(api, 2 * workers):  # the floor's pods may still be terminating
        await measure(api, cluster, fresh_namespace, tmp_path, workers)


async def measure(
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

            converged = await until(workers_ready, 1800)
            after = await apiserver_counts(api)
            own = operator.requests(("get", "list", "apply", "delete", "patch-status", "create"))
            own_writes = operator.requests()
            breakdown = requests_by_verb_and_kind(operator)
            reconciles = operator.reconciles()
            rss = operator.rss_bytes()
            idle: dict[str, float] = {}
            if IDLE_SECONDS > 0:
                # A timed window, not a wait for a condition: what a converged operator sends.
                await asyncio.sleep(IDLE_SECONDS)
                later = requests_by_verb_and_kind(operator)
                idle = {k: later.get(k, 0.0) - breakdown.get(k, 0.0) for k in later}
                idle_reconciles = operator.reconciles() - reconciles
                rss_after_idle = operator.rss_bytes()
            if ADAPTERS > 0:
                await adapters_settle(api, operator, op_ns, names)
    finally:
        await core.delete_namespace(op_ns)

    kopf_patches = after.get(("dynamoworkers", "", "PATCH"), 0) - before.get(
        ("dynamoworkers", "", "PATCH"), 0
    )
    status_patches = after.get(("dynamoworkers", "status", "PATCH"), 0) - before.get(
        ("dynamoworkers", "status", "PATCH"), 0
    )
    ratio = converged / baseline
    goal = GOAL_RATIO.get(workers)
    print(
        f"\n{workers} DynamoWorkers (1 pod each): converged in {converged:.1f} s; "
        f"baseline (Deployments created directly) {baseline:.1f} s; ratio {ratio:.2f}"
        + (f" (goal <= {goal})" if goal else "")
    )
    per_dw = (own + kopf_patches) / workers
    writes = (own_writes + kopf_patches) / workers
    print(
        f"API requests per DynamoWorker: {per_dw:.1f} (goal <= {GOAL_REQUESTS}); writes "
        f"{writes:.1f} (goal <= {GOAL_WRITES}; operator client {own_writes / workers:.1f}, "
        f"kopf's PATCHes of the object {kopf_patches / workers:.1f}; status PATCHes seen by "
        f"the API server {status_patches / workers:.1f}); child reads "
        f"{child_reads(breakdown) / workers:.1f}"
    )
    print(f"  by verb per DynamoWorker: {by_verb(breakdown, workers)}")
    print(
        f"reconciles per DynamoWorker: {reconciles / workers:.1f}; requests by verb and kind: "
        + ", ".join(f"{k} {v / workers:.1f}" for k, v in sorted(breakdown.items()))
    )
    print(
        f"operator RSS: {rss_idle / 2**20:.0f} MiB idle, {rss / 2**20:.0f} MiB with "
        f"{workers} DynamoWorkers"
    )
    if idle:
        print(
            f"idle {IDLE_SECONDS:.0f} s converged: child reads {child_reads(idle):.0f} (goal 0), "
            f"requests {sum(idle.values()):.0f} ("
            + (", ".join(f"{k} {v:.0f}" for k, v in sorted(idle.items()) if v) or "none")
            + f"), reconciles {idle_reconciles:.0f}, RSS {rss_after_idle / 2**20:.0f} MiB"
        )
    MEASURED.append((workers, converged, baseline))
    bench_plots.convergence(MEASURED, "bench-operator-convergence")
