"""Questions the e2e tests ask about a DynamoWorker's pods on the test bed and the upstream
frontend in front of them: requests served and in flight (from each pod's /metrics), each
pod's kv-events channel (from its DynamoWorkerMetadata), whether the frontend subscribed to
them (from its log, which the process node keeps), where KV-aware routing sends prompts
each pod cached through its own route, and what the worker Service resolves to."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from support.cluster import REPO, Cluster
from support.operator_namespace import OperatorNamespace

sys.path.insert(0, str(REPO / "hack"))
from testbed.network import netns_name


async def service_addresses(api: client.ApiClient, namespace: str, service: str) -> list[str]:
    """What a client of the headless Service `service` resolves: the ready addresses of its
    EndpointSlices (the pods', or the activator's while the DynamoWorker is at zero), as the
    cluster's DNS answers."""
    slices = await client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}"
    )
    return sorted(
        address
        for found in slices.items
        for endpoint in found.endpoints or []
        if endpoint.conditions and endpoint.conditions.ready
        for address in endpoint.addresses
    )


# Colour codes in the frontend's log lines (its Rust logger colours them).
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


async def metric_sum(system_url: str, name: str, **labels: str) -> float:
    """The sum of metric `name` over its samples whose labels include `labels`, on the worker
    whose system server is at `system_url` (0 when absent)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(system_url + "/metrics") as response,
    ):
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def worker_metric(ip: str, name: str, **labels: str) -> float:
    """`metric_sum` on the worker pod at `ip`."""
    return await metric_sum(f"http://{ip}:9090", name, **labels)


async def requests_served(ip: str) -> float:
    """dynamo_component_requests_total on the worker pod at `ip`."""
    return await worker_metric(ip, "dynamo_component_requests_total")


async def worker_pods(space: OperatorNamespace, worker: str) -> list[Any]:
    """The DynamoWorker's pods that are not being deleted, by name."""
    listing = await space.core.list_namespaced_pod(
        space.namespace, label_selector=f"dynamo.dev/worker={worker}"
    )
    return sorted(
        (p for p in listing.items if p.metadata.deletion_timestamp is None),
        key=lambda p: p.metadata.name,
    )


async def kv_event_endpoints(space: OperatorNamespace, worker: str) -> dict[str, str]:
    """Pod IP -> the ZMQ endpoint of its kv-events channel, from its DynamoWorkerMetadata."""
    found: dict[str, str] = {}
    for pod in await worker_pods(space, worker):
        record = await space.custom.get_namespaced_custom_object(
            "nvidia.com", "v1alpha1", space.namespace, "dynamoworkermetadatas", pod.metadata.name
        )
        for channel in record["spec"]["data"]["event_channels"].values():
            if channel["topic"] == "kv-events":
                found[pod.status.pod_ip] = channel["transport"]["config"]["endpoint"]
    return found


async def wait_kv_subscriptions(
    space: OperatorNamespace, testbed: Cluster, frontend_pod: Any, endpoints: dict[str, str]
) -> None:
    """Until the frontend pod's log says it subscribed to every kv-events endpoint (events
    sent before that are lost)."""
    log = Path(testbed.kubeconfig).parent / "pods" / frontend_pod.metadata.uid / "main.log"

    async def subscribed() -> set[str]:
        text = ANSI_ESCAPE.sub("", await asyncio.to_thread(log.read_text))
        return {e for e in endpoints.values() if f'endpoint="{e}" topic="kv-events"' in text}

    await space.eventually(
        "subscribed to every kv-events channel",
        subscribed,
        60,
        lambda found: len(found) == len(endpoints),
    )


async def frontend_log(space: OperatorNamespace, worker: str) -> str:
    """The log of the DynamoWorker's running frontend pods (upstream's frontend)."""
    listing = await space.core.list_namespaced_pod(
        space.namespace, label_selector=f"dynamo.dev/frontend={worker}"
    )
    logs = [await space.core.read_namespaced_pod_log(p.metadata.name, space.namespace)
            for p in listing.items if p.status.phase == "Running"]  # fmt: skip
    return "\n".join(logs)


async def generate_on(ip: str, token_ids: list[int]) -> None:
    """One request to a worker's own HTTP route (it caches the prompt's KV blocks)."""
    body = {"token_ids": token_ids, "stop_conditions": {"max_tokens": 1}}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{ip}:8000/v1/generate", json=body) as response,
    ):
        assert response.status == 200
        await response.read()


async def kv_routes(
    url: str, model: str, prompts: dict[str, list[list[int]]]
) -> list[tuple[str, list[str]]]:
    """Cache each pod's `prompts` (by pod IP) through its own route, so that the router learns
    of them only from kv-events; then send each through the frontend at `url`
    (`/v1/completions`). Per prompt: the pod that cached it, and the pods that served it."""
    for ip, cached in prompts.items():
        for prompt in cached:
            await generate_on(ip, prompt)
    ips = list(prompts)
    routed = []
    for ip, cached in prompts.items():
        for prompt in cached:
            before = {w: await requests_served(w) for w in ips}
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
            after = {w: await requests_served(w) for w in ips}
            routed.append((ip, [w for w in ips if after[w] > before[w]]))
    return routed


def worker_pids(pod: Any) -> list[int]:
    """The processes of a process-node pod (everything in its network namespace)."""
    found = subprocess.run(
        ["ip", "netns", "pids", netns_name(pod.metadata.uid)],
        capture_output=True,
        text=True,
        check=True,
    )
    return [int(pid) for pid in found.stdout.split()]


def signal_pod(pod: Any, signum: int) -> None:
    """Send `signum` to every process of a process-node pod."""
    for pid in worker_pids(pod):
        os.kill(pid, signum)


@contextlib.contextmanager
def engine_frozen(pod: Any) -> Iterator[None]:
    """A process-node pod's engine processes stopped (SIGSTOP), and resumed on exit. The pod's
    first process, the worker's own, runs on: it takes requests, answers /metrics and, told to
    stop, drains. Requests it took stay in flight until the engine resumes, however fast the
    engine would have served them."""
    pids = worker_pids(pod)
    engine = [pid for pid in pids if psutil.Process(pid).ppid() in pids]
    for pid in engine:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def delete_while_in_flight(space: OperatorNamespace, pod: Any, count: int) -> None:
    """Wait until `count` requests are in flight on `pod`, delete it (the process node then
    SIGTERMs it, as a kubelet would) and wait until its worker drains those `count`."""
    name = pod.metadata.name
    await space.eventually(
        f"{count} requests in flight on {name}",
        lambda: worker_metric(pod.status.pod_ip, "dynamo_component_inflight_requests"),
        60,
        lambda found: found == count,
    )
    await space.core.delete_namespaced_pod(name, space.namespace)
    await space.eventually(
        f"{name} draining {count}",
        lambda: space.core.read_namespaced_pod_log(name, space.namespace),
        60,
        lambda log: f"draining {count} in-flight request(s)" in log,
    )


async def wait_restarted(
    space: OperatorNamespace,
    pod: Any,
    within: float,
    ready: Callable[[Any], bool],
) -> Any:
    """Until `pod`'s container has restarted since `pod` was read and `ready(pod)` holds; the
    pod as last read."""
    restarts = pod.status.container_statuses[0].restart_count

    async def now() -> Any:
        return await space.core.read_namespaced_pod(pod.metadata.name, space.namespace)

    return await space.eventually(
        f"{pod.metadata.name} restarted",
        now,
        within,
        lambda found: found.status.container_statuses[0].restart_count > restarts and ready(found),
    )
