"""The autoscaler's cost and benefit, in figures printed as ratios against baselines measured
in the same run (printed, not asserted).

1. `test_idle_autoscaler_api_cost`: 100 idle DynamoWorkers on the fake nodes (their pods are
   Ready but serve nothing, so every load read fails fast and counts as no load), first
   without spec.autoscaling (the baseline), then with it: the operator's API requests per
   DynamoWorker per minute over an idle window, and the extra the autoscaler costs. Goal:
   <= 1 extra request per DynamoWorker per minute.
2. `test_autoscale_profile`: a fixed load profile from a real OpenAI client against the tiny
   model on the process node (sample engine, 50 ms a token): idle, 8 concurrent streams,
   idle long enough to reach zero, a burst of 8, idle. Once with a static `replicas:
   maxReplicas`, once autoscaled (minReplicas 0, maxReplicas 4). Printed: pod-seconds used
   (autoscaled / static, goal <= 0.5), TTFT p90 during the steady load (goal <= 1.3x),
   failed requests (goal 0), and the first-token latency of a request sent at zero against a
   cold-start floor measured in the same run (a pod's own creation-to-ready time plus one
   request; goal <= floor + 2 s).

Run: `.venv/bin/pytest tests/bench/bench_autoscale.py -m bench -s` (DYNAMO_BENCH_IDLE_WORKERS
and DYNAMO_BENCH_IDLE_SECONDS change part 1; DYNAMO_BENCH_PROFILE_SCALE shortens part 2's
phases, e.g. 0.25 for a quick look).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from support.api_cases import dynamo_worker
from support.cluster import Cluster, eventually
from support.operator_process import OperatorProcess, running_operator

pytestmark = [pytest.mark.bench, pytest.mark.cluster]

IDLE_WORKERS = int(os.environ.get("DYNAMO_BENCH_IDLE_WORKERS", "100"))
IDLE_SECONDS = float(os.environ.get("DYNAMO_BENCH_IDLE_SECONDS", "60"))
SPEC = {"replicas": 1, "resources": {"gpusPerPod": 0}}
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 2, "targetInFlightPerPod": 4}


@pytest_asyncio.fixture
async def namespace(api: client.ApiClient) -> AsyncIterator[str]:
    await install_crds(OperatorCluster(api))
    core = client.CoreV1Api(api)
    name = f"bench-as-{uuid.uuid4().hex[:8]}"
    await core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
    await eventually(lambda: core.read_namespaced_service_account("default", name), 30)
    yield name
    await core.delete_namespace(name)


def all_requests(operator: OperatorProcess) -> float:
    """Every API request the operator's client made (reads and writes)."""
    return operator.requests(verbs=("get", "list", "apply", "delete", "patch-status",
                                    "create", "patch", "get-log"))  # fmt: skip


async def idle_cost(
    api: client.ApiClient, cluster: Cluster, namespace: str, log: Path, spec: dict[str, Any]
) -> float:
    """API requests per DynamoWorker per minute while `IDLE_WORKERS` converged workers idle."""
    custom = client.CustomObjectsApi(api)
    names = [f"idle-{i:04d}" for i in range(IDLE_WORKERS)]
    with running_operator(cluster, [namespace], log) as operator:
        for name in names:
            await custom.create_namespaced_custom_object(
                "dynamo.dev", "v1alpha1", namespace, "dynamoworkers", dynamo_worker(name, spec)
            )

        async def ready_count() -> int:
            listed = await custom.list_namespaced_custom_object(
                "dynamo.dev", "v1alpha1", namespace, "dynamoworkers"
            )
            return sum(
                any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (w.get("status") or {}).get("conditions") or []
                )
                for w in listed["items"]
            )

        await eventually(ready_count, 600, lambda n: n == IDLE_WORKERS)
        # Let the first autoscaler reads (and their one status refresh) pass.
        await asyncio.sleep(10)
        before, started = all_requests(operator), time.monotonic()
        await asyncio.sleep(IDLE_SECONDS)
        spent = all_requests(operator) - before
        minutes = (time.monotonic() - started) / 60
        for name in names:
            await custom.delete_namespaced_custom_object(
                "dynamo.dev", "v1alpha1", namespace, "dynamoworkers", name
            )
        return spent / IDLE_WORKERS / minutes


async def test_idle_autoscaler_api_cost(
    api: client.ApiClient, cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    static = await idle_cost(api, cluster, namespace, tmp_path / "static.log", SPEC)
    second = f"{namespace}-b"
    core = client.CoreV1Api(api)
    await core.create_namespace({"metadata": {"name": second}})  # type: ignore[arg-type]
    try:
        await eventually(lambda: core.read_namespaced_service_account("default", second), 30)
        autoscaled = await idle_cost(
            api,
            cluster,
            second,
            tmp_path / "autoscaled.log",
            {**SPEC, "autoscaling": AUTOSCALING},
        )
    finally:
        await core.delete_namespace(second)
    print(
        f"\n[bench_autoscale] {IDLE_WORKERS} idle DynamoWorkers, {IDLE_SECONDS:.0f} s window: "
        f"API requests per DynamoWorker per minute: static {static:.2f}, "
        f"autoscaled {autoscaled:.2f}, extra {autoscaled - static:+.2f} (goal <= 1)"
    )
