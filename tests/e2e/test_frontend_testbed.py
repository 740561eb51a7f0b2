"""spec.frontend end to end on the test bed: the operator (a subprocess) deploys upstream
Dynamo's own frontend (ai-dynamo 1.6.1, from the venv `hack/oracle-venv` makes) in front of
our worker pods. Frontend and workers are process-node pods with their own IPs; the frontend
finds the workers through upstream's Kubernetes discovery (EndpointSlices plus
DynamoWorkerMetadata, read with its own ServiceAccount's token and Role), downloads their
model-card files over HTTP from the workers' system ports, and routes over upstream's TCP
request plane. Clients reach it at its Service's ClusterIP (the test bed's service proxy).

Steps, in order: a chat completion through the Service, answered by both workers in turn;
the status; a drain (5 streams through the frontend, a worker pod deleted 3 s in: all 5
complete); KV-aware routing (routerMode kv: repeated prompts go to the pod whose kv-events
announced them); then removing spec.frontend removes every frontend child.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from typing import Any, TypeVar, get_args

import aiohttp
import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.api.dynamoworker import RouterMode
from dynamo_operator.reconcile.dynamoworker.interface import FrontendEnv
from support.cluster import Cluster
from support.operator_namespace import (
    GROUP,
    MERGE,
    ON_PROCESS_NODE,
    VERSION,
    OperatorNamespace,
    operator_namespace,
)
from support.testbed_workers import (
    kv_event_endpoints,
    kv_routes,
    requests_served,
    wait_kv_subscriptions,
)
from support.tiny_model import TinyModel
from support.upstream import SAMPLE_ENGINE, streams_in_flight, upstream_python

pytestmark = pytest.mark.e2e

WORKER = "tiny"
SERVED = "tiny-llama"
FRONTEND = f"{WORKER}-frontend"
T = TypeVar("T")


class Bed(OperatorNamespace):
    """The namespace, with this module's questions about its worker."""

    async def worker(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "dynamoworkers", WORKER
        )
        return found

    async def worker_pod_ips(self) -> list[str]:
        listing = await self.core.list_namespaced_pod(
            self.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
        )
        return sorted(p.status.pod_ip for p in listing.items if p.status.pod_ip)


def ready(obj: dict[str, Any]) -> str | None:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition["type"] == "Ready":
            return str(condition["status"])
    return None


def test_frontend_env_and_router_modes_are_upstreams() -> None:
    """What the operator configures the frontend with is what upstream's frontend reads."""
    shown = subprocess.run(
        [str(upstream_python()), "-m", "dynamo.frontend", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for name in FrontendEnv:
        assert f"env var: {name} " in shown, name
    modes = re.search(r"--router-mode \{([^}]*)\}", shown)
    assert modes is not None
    assert set(get_args(RouterMode)) <= set(modes.group(1).split(","))


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    python = upstream_python()
    log_dir = tmp_path_factory.mktemp("frontend-operator")
    async with operator_namespace(api, testbed, "t-fe", log_dir) as space:
        shutil.copytree(tiny_model.base, space.shared / "base")
        worker: Any = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DynamoWorker",
            "metadata": {"name": WORKER},
            "spec": {
                "model": {"name": SERVED, "source": str(space.shared / "base")},
                "replicas": 2,
                # 50 ms a token: the drain step's streams run about 6 s.
                "engine": {"class": SAMPLE_ENGINE, "extraArgs": ["--token-delay", "0.05"]},
                "resources": {"gpusPerPod": 0},
                "drain": {"gracePeriodSeconds": 1, "drainTimeoutSeconds": 15},
                "pod": ON_PROCESS_NODE,
                "frontend": {
                    # The process node ignores images; the command is what runs.
                    "image": "nvcr.io/nvidia/ai-dynamo/vllm-runtime:1.6.1",
                    "command": [str(python), "-m", "dynamo.frontend"],
                    "pod": ON_PROCESS_NODE,
                },
            },
        }
        await space.create("dynamoworkers", worker)
        yield Bed(**vars(space))


async def test_chat_through_the_frontend_service_reaches_both_workers(bed: Bed) -> None:
    found = await bed.eventually("Ready", bed.worker, 240, lambda w: ready(w) == "True")
    frontend = found["status"]["frontend"]
    assert frontend["readyReplicas"] == 1
    assert frontend["url"] == f"http://{FRONTEND}.{bed.namespace}.svc:8000"
    service = await bed.core.read_namespaced_service(FRONTEND, bed.namespace)
    base = f"http://{service.spec.cluster_ip}:8000"

    async def models() -> list[str]:
        async with aiohttp.ClientSession() as session, session.get(base + "/v1/models") as r:
            return [m["id"] for m in (await r.json())["data"]]

    async def instances() -> list[str]:
        # The frontend's /health lists the worker instances it routes to.
        async with aiohttp.ClientSession() as session, session.get(base + "/health") as r:
            listed = (await r.json(content_type=None))["instances"]
        return sorted(i["transport"]["tcp"].split(":")[0] for i in listed)

    # Discovery lists a worker once its pod is ready in the EndpointSlice and its card files
    # were fetched; wait until the model is served and both workers are routable.
    await bed.eventually("model listed", models, 60, lambda ids: SERVED in ids)
    ips = await bed.worker_pod_ips()
    assert len(ips) == 2
    await bed.eventually("both workers routable", instances, 60, lambda found: found == ips)
    before = {ip: await requests_served(ip) for ip in ips}
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
    }

    async def chat() -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(base + "/v1/chat/completions", json=body) as response,
        ):
            answer: dict[str, Any] = await response.json(content_type=None)
            assert response.status == 200, answer
            return answer

    answers = [await chat() for _ in range(6)]
    for answer in answers:
        assert answer["model"] == SERVED
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["message"]["content"]
    served = {ip: await requests_served(ip) - before[ip] for ip in ips}
    # Round robin over both pods.
    assert sum(served.values()) == 6, served
    assert all(count >= 1 for count in served.values()), served


async def test_frontend_pods_are_not_workers(bed: Bed) -> None:
    found = await bed.worker()
    # The worker pod list in status holds only the two workers, never the frontend pod.
    assert len(found["status"]["pods"]) == 2
    listing = await bed.core.list_namespaced_pod(
        bed.namespace, label_selector=f"dynamo.dev/frontend={WORKER}"
    )
    [pod] = listing.items
    assert "dynamo.dev/worker" not in pod.metadata.labels
    assert pod.spec.service_account_name == FRONTEND


async def test_drain_through_the_frontend(bed: Bed) -> None:
    service = await bed.core.read_namespaced_service(FRONTEND, bed.namespace)
    url = f"http://{service.spec.cluster_ip}:8000/v1/completions"
    body = {
        "model": SERVED,
        "prompt": "drain me",
        "max_tokens": 120,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # Round robin puts the streams on both pods; once every one has begun, delete one pod
    # (SIGTERM from the process node, as from a kubelet): it turns unready, leaves discovery,
    # and its streams must finish.
    streams = await streams_in_flight(url, body, 5)
    listing = await bed.core.list_namespaced_pod(
        bed.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
    )
    victim = sorted(p.metadata.name for p in listing.items)[0]
    await bed.core.delete_namespaced_pod(victim, bed.namespace)
    results = await asyncio.gather(*streams)
    for status, events in results:
        assert status == 200, events
        assert events[-1] == "[DONE]"
        usage = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert usage, events[-3:]
        assert usage[-1]["completion_tokens"] == 120, events[-3:]
    # The Deployment replaces the pod; the worker is whole again.
    await bed.eventually(
        "2 ready workers", bed.worker, 120, lambda w: w["status"].get("readyReplicas") == 2
    )


async def frontend_pod(bed: Bed) -> Any:
    listing = await bed.core.list_namespaced_pod(
        bed.namespace, label_selector=f"dynamo.dev/frontend={WORKER}"
    )
    [pod] = [p for p in listing.items if p.metadata.deletion_timestamp is None]
    return pod


async def test_kv_aware_routing_across_pods(bed: Bed, testbed: Cluster) -> None:
    await bed.custom.patch_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, "dynamoworkers", WORKER,
        {"spec": {"frontend": {"routerMode": "kv"}}}, **MERGE,
    )  # fmt: skip

    async def kv_frontend() -> Any:
        pod = await frontend_pod(bed)
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        return pod if env.get("DYN_ROUTER_MODE") == "kv" and ready else None

    pod = await bed.eventually("a kv-mode frontend", kv_frontend, 120, lambda p: p is not None)
    ips = await bed.worker_pod_ips()
    endpoints = await bed.eventually(
        "kv-events channels", lambda: kv_event_endpoints(bed, WORKER), 30, lambda e: len(e) == 2
    )
    # The frontend subscribes to each worker's kv-events over the pod network.
    await wait_kv_subscriptions(bed, testbed, pod, endpoints)
    service = await bed.core.read_namespaced_service(FRONTEND, bed.namespace)
    url = f"http://{service.spec.cluster_ip}:8000/v1/completions"
    # Each worker caches other prompts (4 blocks of 16 tokens each).
    prompts = {
        ip: [[100 + 50 * index + 7 * n + j % 40 for j in range(64)] for n in range(3)]
        for index, ip in enumerate(ips)
    }
    routed = await kv_routes(url, SERVED, prompts)
    # Random placement would get all six right one time in 64.
    assert routed == [(ip, [ip]) for ip in ips for _ in range(3)], routed


async def test_removing_the_frontend_removes_its_children(bed: Bed) -> None:
    await bed.custom.patch_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, "dynamoworkers", WORKER,
        {"spec": {"frontend": None}}, **MERGE,
    )  # fmt: skip
    apps = client.AppsV1Api(bed.api)
    rbac = client.RbacAuthorizationV1Api(bed.api)
    reads = {
        "Deployment": lambda: apps.read_namespaced_deployment(FRONTEND, bed.namespace),
        "Service": lambda: bed.core.read_namespaced_service(FRONTEND, bed.namespace),
        "ServiceAccount": lambda: bed.core.read_namespaced_service_account(FRONTEND, bed.namespace),
        "Role": lambda: rbac.read_namespaced_role(FRONTEND, bed.namespace),
        "RoleBinding": lambda: rbac.read_namespaced_role_binding(FRONTEND, bed.namespace),
    }

    async def left() -> list[str]:
        remaining = []
        for kind, read in reads.items():
            try:
                await read()
            except ApiException as err:
                if err.status == 404:
                    continue
                raise
            remaining.append(kind)
        return remaining

    await bed.eventually("frontend children deleted", left, 60, lambda kinds: kinds == [])
    found = await bed.eventually(
        "status without frontend",
        bed.worker,
        30,
        lambda w: "frontend" not in w["status"] and ready(w) == "True",
    )
    assert found["status"]["readyReplicas"] == 2
