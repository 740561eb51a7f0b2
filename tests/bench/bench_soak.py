"""Soak: many DynamoWorkers and LoRAAdapters while pods are deleted at random (`-m bench`).

`DYNAMO_SOAK_WORKERS` DynamoWorkers (200) and as many LoRAAdapters (one each): all but
`SERVING` of them on the fake nodes (one replica, LoRA disabled: their pods run nothing, so
their adapters settle as `LoRADisabled`), and `SERVING` with LoRA enabled and 2 replicas on
the process node (SampleEngine), each with an adapter from a `file://` folder the pods read.
The operator runs behind a counting proxy (`support.api_proxy`), so every request it sends
is counted, kopf's included. Once everything has settled, an idle minute is the baseline;
then for `DYNAMO_SOAK_MINUTES` (20) a random worker pod is deleted every
`DELETE_EVERY_SECONDS`, alternating between a fake-node pod and a serving pod (a serving
DynamoWorker is hit again only once its adapter is back on both pods).

Printed: the operator's RSS at start and end (and their ratio); reconcile errors (start and
end of the soak, by kind); p50/p99 time from a serving pod's deletion to its adapter
`Loaded` on both pods again, and from the replacement pod turning Ready to that; API
requests per minute during the soak, as a ratio to the idle minute's (writes apart).
Asserts only that every serving adapter came back each time.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from bench.bench_operator import bounded
from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from support.api_cases import dynamo_worker, lora_adapter
from support.api_proxy import ApiProxy, api_proxy
from support.cluster import Cluster, create_test_namespace
from support.fault_matrix import release_finalizers
from support.operator_namespace import serving_worker_spec
from support.operator_process import OperatorProcess, start_operator
from support.tiny_model import TinyModel
from support.worker_admin import chart_worker_admin

GROUP, VERSION = "dynamo.dev", "v1alpha1"
MINUTES = float(os.environ.get("DYNAMO_SOAK_MINUTES", "20"))
WORKERS = int(os.environ.get("DYNAMO_SOAK_WORKERS", "200"))
SERVING = 2
DELETE_EVERY_SECONDS = 5.0
IDLE_SECONDS = 60.0
SETTLE_WITHIN = 900.0
RECOVER_WITHIN = 180.0
# The run's own length and its worst waits, past the suite's 10-minute test timeout.
TIMEOUT_SECONDS = MINUTES * 60 + IDLE_SECONDS + SETTLE_WITHIN + RECOVER_WITHIN + 300

pytestmark = [pytest.mark.bench, pytest.mark.cluster, pytest.mark.timeout(TIMEOUT_SECONDS)]
POLL_SECONDS = 0.5
FAKE_SPEC = {"replicas": 1, "resources": {"gpusPerPod": 0}}


def served_name(i: int) -> str:
    return f"s{i}"


def fake_name(i: int) -> str:
    return f"w{i:03d}"


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def settled(adapter: dict[str, Any]) -> bool:
    status = adapter.get("status") or {}
    return "Ready" in _conditions(adapter) and status.get("observedGeneration") == adapter[
        "metadata"
    ].get("generation")


def loaded_on(adapter: dict[str, Any], pods: set[str]) -> bool:
    """The adapter is Loaded on exactly `pods`."""
    states = {p["pod"]: p["state"] for p in (adapter.get("status") or {}).get("pods") or []}
    return set(states) == pods and all(s == "Loaded" for s in states.values())


@dataclass
class Soak:
    api: client.ApiClient
    namespace: str
    operator: OperatorProcess
    proxy: ApiProxy
    recoveries: list[float] = field(default_factory=list)  # deletion -> Loaded again
    after_ready: list[float] = field(default_factory=list)  # new pod Ready -> Loaded again
    fake_deletions: int = 0

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    async def adapters(self) -> list[dict[str, Any]]:
        listing = await self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters"
        )
        return list(listing["items"])

    async def workers(self) -> list[dict[str, Any]]:
        listing = await self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "dynamoworkers"
        )
        return list(listing["items"])

    async def pods(self, worker: str) -> list[Any]:
        listing = await self.core.list_namespaced_pod(
            self.namespace, label_selector=f"dynamo.dev/worker={worker}"
        )
        return [p for p in listing.items if p.metadata.deletion_timestamp is None]

    async def ready_pods(self, worker: str) -> dict[str, float | None]:
        """Ready pods of `worker` by name, with the time their Ready condition says."""
        found: dict[str, float | None] = {}
        for pod in await self.pods(worker):
            for c in pod.status.conditions or []:
                if c.type == "Ready" and c.status == "True":
                    found[pod.metadata.name] = (
                        c.last_transition_time.timestamp() if c.last_transition_time else None
                    )
        return found

    async def serving_adapter(self, i: int) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters", served_name(i)
        )
        return found

    async def recover(self, i: int) -> None:
        """Delete one pod of serving worker `i` and time its adapter's return to 2 pods."""
        worker = served_name(i)
        victim = random.choice(await self.pods(worker)).metadata.name
        deleted_at, deleted_wall = time.monotonic(), time.time()
        await self.core.delete_namespaced_pod(victim, self.namespace)
        while time.monotonic() - deleted_at < RECOVER_WITHIN:
            ready = await self.ready_pods(worker)
            back = len(ready) == 2 and victim not in ready
            if back and loaded_on(await self.serving_adapter(i), set(ready)):
                now, wall = time.monotonic(), time.time()
                self.recoveries.append(now - deleted_at)
                # Ready's transition time has whole seconds only.
                new_ready = max((t for t in ready.values() if t is not None), default=None)
                if new_ready is not None and new_ready >= deleted_wall - 1:
                    self.after_ready.append(max(0.0, wall - new_ready))
                return
            await asyncio.sleep(POLL_SECONDS)
        raise AssertionError(
            f"{worker}: adapter not back on 2 pods {RECOVER_WITHIN} s after {victim}"
        )

    async def delete_a_fake_pod(self) -> None:
        pods = await self.pods(fake_name(random.randrange(WORKERS - SERVING)))
        if pods:  # none while its replacement is being made
            await self.core.delete_namespaced_pod(random.choice(pods).metadata.name, self.namespace)
            self.fake_deletions += 1

    def reconcile_errors(self) -> dict[str, float]:
        return {
            dict(labels)["kind"]: value
            for (name, labels), value in self.operator.metrics().items()
            if name == "dynamo_operator_reconcile_errors_total"
        }

    def requests_per_minute(self, since: float, until: float) -> tuple[float, float]:
        """Requests (watches aside) and writes per minute the operator sent in the window."""
        sent = [r for r in self.proxy.requests(since) if not r.watch and r.at <= until]
        minutes = (until - since) / 60
        return len(sent) / minutes, sum(1 for r in sent if r.is_write) / minutes


@pytest_asyncio.fixture
async def soak_namespace(api: client.ApiClient) -> AsyncIterator[str]:
    name = await create_test_namespace(api, "soak")
    yield name
    await release_finalizers(api, name)  # the operator has stopped by now
    await client.CoreV1Api(api).delete_namespace(name)


async def create_objects(soak: Soak, shared: Path) -> None:
    custom, ns = soak.custom, soak.namespace
    bodies: list[tuple[str, Any]] = []
    for i in range(WORKERS - SERVING):
        bodies.append(("dynamoworkers", dynamo_worker(fake_name(i), FAKE_SPEC)))
        target = {"workerRef": {"name": fake_name(i)}}
        bodies.append(("loraadapters", lora_adapter(fake_name(i), target)))
    for i in range(SERVING):
        spec = serving_worker_spec(shared / "base")
        bodies.append(("dynamoworkers", dynamo_worker(served_name(i), spec)))
        source = {"uri": (shared / "sql-lora").as_uri()}
        adapter = {"workerRef": {"name": served_name(i)}, "source": source}
        bodies.append(("loraadapters", lora_adapter(served_name(i), adapter)))
    await bounded(
        [custom.create_namespaced_custom_object(GROUP, VERSION, ns, p, b) for p, b in bodies]
    )


def worker_ready(worker: dict[str, Any]) -> bool:
    """Ready=True for the current generation: the status tail of its rollout is over, so the
    idle minute that follows measures an operator with nothing to do."""
    ready = _conditions(worker).get("Ready") or {}
    generation = worker["metadata"].get("generation")
    return ready.get("status") == "True" and ready.get("observedGeneration") == generation


async def all_settled(soak: Soak) -> bool:
    adapters = await soak.adapters()
    if len(adapters) != WORKERS or not all(map(settled, adapters)):
        return False
    workers = await soak.workers()
    if len(workers) != WORKERS or not all(map(worker_ready, workers)):
        return False
    for i in range(SERVING):
        ready = await soak.ready_pods(served_name(i))
        if len(ready) != 2 or not loaded_on(await soak.serving_adapter(i), set(ready)):
            return False
    return True


def quantile(values: list[float], q: int) -> float:
    """The `q`th percentile (nan for no values)."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def test_soak(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    soak_namespace: str,
    tmp_path: Path,
) -> None:
    await install_crds(OperatorCluster(api))
    shared = Path(testbed.kubeconfig).parent / "e2e" / f"soak-{uuid.uuid4().hex[:8]}"
    shutil.copytree(tiny_model.base, shared / "base")
    shutil.copytree(tiny_model.adapters["sql-lora"], shared / "sql-lora")
    try:
        async with chart_worker_admin(api, soak_namespace, tmp_path) as token:
            with api_proxy(testbed.kubeconfig) as proxy:
                operator = start_operator(
                    testbed,
                    [soak_namespace],
                    tmp_path / "operator.log",
                    resync_seconds=30.0,
                    kubeconfig=proxy.kubeconfig(tmp_path / "proxy.kubeconfig"),
                    extra_args=("--worker-token-file", str(token)),
                )
                try:
                    await operator.wait_serving()
                    await run_soak(Soak(api, soak_namespace, operator, proxy), shared)
                finally:
                    operator.stop()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


async def run_soak(soak: Soak, shared: Path) -> None:
    started = time.monotonic()
    await create_objects(soak, shared)
    await soak.operator.eventually(
        "everything settled", lambda: all_settled(soak), SETTLE_WITHIN, bool
    )
    took = time.monotonic() - started
    print(f"\n{WORKERS} DynamoWorkers + {WORKERS} LoRAAdapters settled in {took:.0f} s")

    idle_from = time.monotonic()
    await asyncio.sleep(IDLE_SECONDS)  # the baseline: a window with nothing to do
    idle_requests, idle_writes = soak.requests_per_minute(idle_from, time.monotonic())
    rss_start, errors_start = soak.operator.rss_bytes(), soak.reconcile_errors()

    soak_from = time.monotonic()
    deadline = soak_from + MINUTES * 60
    recovering: dict[int, asyncio.Task[None]] = {}
    serving_turn = False
    while time.monotonic() < deadline:
        if serving_turn:
            free = [i for i in range(SERVING) if i not in recovering or recovering[i].done()]
            for i in list(recovering):
                if recovering[i].done():
                    recovering.pop(i).result()
            if free:
                i = random.choice(free)
                recovering[i] = asyncio.create_task(soak.recover(i))
        else:
            await soak.delete_a_fake_pod()
        serving_turn = not serving_turn
        await asyncio.sleep(DELETE_EVERY_SECONDS)
    for task in recovering.values():
        await task
    soak_until = time.monotonic()
    soak_requests, soak_writes = soak.requests_per_minute(soak_from, soak_until)
    rss_end, errors_end = soak.operator.rss_bytes(), soak.reconcile_errors()
    assert soak.operator.exited() is None, soak.operator.log_tail()

    recoveries, after_ready = soak.recoveries, soak.after_ready
    mib = 2**20
    print(
        f"soak: {(soak_until - soak_from) / 60:.1f} min, {soak.fake_deletions} fake-node pods "
        f"and {len(recoveries)} serving pods deleted"
    )
    print(
        f"operator RSS: start {rss_start / mib:.0f} MiB, end {rss_end / mib:.0f} MiB "
        f"({rss_end / rss_start:.2f}x)"
    )
    print(f"reconcile errors: start {errors_start or 0}, end {errors_end or 0}")
    print(
        "serving pod deleted -> its adapter Loaded on 2 pods again: "
        f"p50 {quantile(recoveries, 50):.1f} s, p99 {quantile(recoveries, 99):.1f} s "
        f"(n={len(recoveries)}); replacement Ready -> Loaded: p50 "
        f"{quantile(after_ready, 50):.1f} s, p99 {quantile(after_ready, 99):.1f} s "
        f"(n={len(after_ready)})"
    )
    print(
        f"API requests per minute (watches aside): idle {idle_requests:.0f} (writes "
        f"{idle_writes:.0f}), soak {soak_requests:.0f} (writes {soak_writes:.0f}): "
        f"{soak_requests / max(idle_requests, 1e-9):.2f}x idle"
    )
