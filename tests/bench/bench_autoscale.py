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
phases, e.g. 0.25 for a quick look; DYNAMO_BENCH_TARGET_IN_FLIGHT the autoscaled run's
target, 4 by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from support.api_cases import dynamo_worker
from support.cluster import Cluster, eventually
from support.operator_namespace import ON_PROCESS_NODE, operator_namespace, serving_worker_spec
from support.operator_process import OperatorProcess, running_operator
from support.testbed_workers import service_addresses
from support.tiny_model import TinyModel

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


@pytest.mark.timeout(1800)
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


# -- 2. the load profile ----------------------------------------------------------------------

PROFILE_SCALE = float(os.environ.get("DYNAMO_BENCH_PROFILE_SCALE", "1"))
STREAMS = 8
MAX_PODS = 4
TOKENS = 40  # 2 s a stream at 50 ms a token
PROFILE_WORKER = "profile"
# In-flight requests per pod the autoscaled run targets: the sample engine serves 4 streams at
# once as fast as 1 (its tokens are timed, not computed), so 8 streams want 2 pods.
TARGET = int(os.environ.get("DYNAMO_BENCH_TARGET_IN_FLIGHT", "4"))


@dataclass
class Profile:
    """What one run of the load profile measured."""

    pod_seconds: float = 0.0
    steady_ttfts: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    zero_first_token: float | None = None  # the burst's first request, sent at zero
    cold_start_floor: float | None = None  # that request's pod: created to ready


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def first_token(base: str, served: str) -> float:
    """One streamed chat completion with the OpenAI client: seconds to its first token."""
    started = time.monotonic()
    first: float | None = None
    async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600) as oai:
        answer = await oai.chat.completions.create(
            model=served,
            messages=[{"role": "user", "content": "benchmark"}],
            max_tokens=TOKENS,
            stream=True,
        )
        async for chunk in answer:
            if first is None and any(c.delta.content for c in chunk.choices):
                first = time.monotonic() - started
    if first is None:
        raise AssertionError("no token")
    return first


async def run_profile(api: client.ApiClient, namespace: str, worker: str, served: str) -> Profile:
    """Idle, 8 streams, idle, a burst of 8, idle (phases scaled by PROFILE_SCALE)."""
    result = Profile()
    core = client.CoreV1Api(api)
    stop = asyncio.Event()
    turn = 0

    async def count_pods() -> None:
        while not stop.is_set():
            pods = await core.list_namespaced_pod(
                namespace, label_selector=f"dynamo.dev/worker={worker}"
            )
            result.pod_seconds += len(pods.items)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def request() -> float | None:
        nonlocal turn
        addresses = await service_addresses(api, namespace, worker)
        if not addresses:
            result.failures.append("no ready address")
            return None
        turn += 1
        base = f"http://{addresses[turn % len(addresses)]}:8000/v1"
        try:
            return await first_token(base, served)
        except (openai.APIError, AssertionError) as err:
            result.failures.append(f"{type(err).__name__}: {err}")
            return None

    async def stream_loop(until: float) -> None:
        while time.monotonic() < until:
            ttft = await request()
            if ttft is not None:
                result.steady_ttfts.append(ttft)

    counter = asyncio.create_task(count_pods())
    try:
        await asyncio.sleep(60 * PROFILE_SCALE)
        until = time.monotonic() + 120 * PROFILE_SCALE
        await asyncio.gather(*(stream_loop(until) for _ in range(STREAMS)))
        await asyncio.sleep(120 * PROFILE_SCALE)
        at_zero = not (
            await core.list_namespaced_pod(namespace, label_selector=f"dynamo.dev/worker={worker}")
        ).items
        burst = await asyncio.gather(*(request() for _ in range(STREAMS)))
        if at_zero and burst[0] is not None:
            result.zero_first_token = burst[0]
            result.cold_start_floor = await cold_start(core, namespace, worker)
        await asyncio.sleep(30 * PROFILE_SCALE)
    finally:
        stop.set()
        await counter
    return result


async def cold_start(core: client.CoreV1Api, namespace: str, worker: str) -> float | None:
    """The newest worker pod's creation-to-ready time."""
    pods = (
        await core.list_namespaced_pod(namespace, label_selector=f"dynamo.dev/worker={worker}")
    ).items
    if not pods:
        return None
    newest = max(pods, key=lambda pod: pod.metadata.creation_timestamp)
    ready = [c for c in newest.status.conditions or [] if c.type == "Ready" and c.status == "True"]
    if not ready:
        return None
    return (ready[0].last_transition_time - newest.metadata.creation_timestamp).total_seconds()


def profile_spec(base_model: Path, autoscaling: dict[str, Any] | None) -> dict[str, Any]:
    spec = serving_worker_spec(base_model, replicas=MAX_PODS)
    spec["engine"]["extraArgs"] = ["--token-delay", "0.05"]
    spec["drain"] = {"gracePeriodSeconds": 1, "drainTimeoutSeconds": 30}
    if autoscaling is not None:
        spec["autoscaling"] = {**autoscaling, "activatorPod": ON_PROCESS_NODE}
    return spec


@pytest.mark.timeout(3600)
async def test_autoscale_profile(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    window = max(5, int(30 * PROFILE_SCALE))
    runs = {
        "static": None,
        "autoscaled": {
            "minReplicas": 0,
            "maxReplicas": MAX_PODS,
            "targetInFlightPerPod": TARGET,
            "scaleDownWindowSeconds": window,
            "scaleToZeroAfterSeconds": window,
        },
    }
    results: dict[str, Profile] = {}
    for label, autoscaling in runs.items():
        log_dir = tmp_path_factory.mktemp(f"profile-{label}")
        async with operator_namespace(api, testbed, f"b-{label[:4]}", log_dir) as space:
            shutil.copytree(tiny_model.base, space.shared / "base")
            body = {
                "apiVersion": "dynamo.dev/v1alpha1",
                "kind": "DynamoWorker",
                "metadata": {"name": PROFILE_WORKER},
                "spec": profile_spec(space.shared / "base", autoscaling),
            }
            await space.create("dynamoworkers", body)
            await eventually(
                lambda: service_addresses(api, space.namespace, PROFILE_WORKER),
                300,
                lambda addresses: len(addresses) == MAX_PODS,
            )
            results[label] = await run_profile(api, space.namespace, PROFILE_WORKER, "tiny-llama")
    static, auto = results["static"], results["autoscaled"]
    print(f"\n[bench_autoscale] load profile (phases x{PROFILE_SCALE}), static {MAX_PODS} pods "
          f"vs autoscaled 0..{MAX_PODS} ({TARGET} in flight per pod):")  # fmt: skip
    print(
        f"  pod-seconds: static {static.pod_seconds:.0f}, autoscaled {auto.pod_seconds:.0f}, "
        f"ratio {auto.pod_seconds / static.pod_seconds:.2f} (goal <= 0.5)"
    )
    print(
        f"  TTFT p90 in the steady load: static {p(static.steady_ttfts, 0.9):.3f} s, "
        f"autoscaled {p(auto.steady_ttfts, 0.9):.3f} s, ratio "
        f"{p(auto.steady_ttfts, 0.9) / p(static.steady_ttfts, 0.9):.2f} (goal <= 1.3)"
    )
    print(
        f"  failed requests: static {len(static.failures)}, autoscaled {len(auto.failures)} "
        f"(goal 0) {sorted(set(auto.failures))[:3]}"
    )
    if auto.zero_first_token is not None and auto.cold_start_floor is not None:
        floor = auto.cold_start_floor + p(static.steady_ttfts, 0.5)
        print(
            f"  first token of a request at zero: {auto.zero_first_token:.1f} s; cold-start "
            f"floor (pod created to ready {auto.cold_start_floor:.1f} s + one request "
            f"{p(static.steady_ttfts, 0.5):.2f} s) {floor:.1f} s; over the floor "
            f"{auto.zero_first_token - floor:+.1f} s (goal <= +2 s)"
        )
    else:
        print("  the burst did not arrive at zero (the idle phase was shorter than the way down)")
