"""The machinery of the fault matrix (`tests/cluster/test_faults.py`): operators behind
counting proxies, the faults, convergence to a step's target, and what a run left.

A scenario is steps (`Step`, a coroutine on the run's `Space`), each with the `Target` it
converges to: the DynamoWorker `NAME` with so many ready replicas (or gone), and each
LoRAAdapter serving a source on every ready pod (or gone, or waiting for its DynamoWorker).
`run_scenario` runs the setup under a fault-free operator, then each step under the fault,
and returns the `Outcome` the invariants compare with the same scenario run without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.handlers.lifecycle import WATCH_INACTIVITY_SECONDS
from support.api_proxy import ApiProxy, api_proxy
from support.cluster import Cluster, eventually, hack_cluster
from support.dynamo_workers import (
    GROUP,
    PLURAL,
    VERSION,
    children,
    get_worker,
    is_ready,
    owned_by,
)
from support.dynamo_workers import pods as worker_pods
from support.operator_process import OperatorProcess, start_operator
from support.s3 import S3Server

NAME = "faulty"
ADAPTERS = "loraadapters"
FINALIZER = "dynamo.dev/finalizer"
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
LEASE_SECONDS, RETRY_SECONDS = 4.0, 1.0
ELECTION_ARGS = (
    "--leader-election",
    f"--lease-duration-seconds={LEASE_SECONDS}",
    f"--lease-retry-seconds={RETRY_SECONDS}",
)
CONVERGE_WITHIN = 90.0
SETTLE_WITHIN = 30.0
OUTAGE_SECONDS = 8.0
MAX_KILLS = 40
SYSTEM_PORT = 9090
READINESS_GATE = "dynamo.dev/lora-adapters-ready"
# What a LoRAAdapter converges to, besides a source URI served on every ready pod.
GONE = "gone"
WORKER_NOT_FOUND = "WorkerNotFound"


@dataclass(frozen=True)
class LoraBed:
    """What a LoRA scenario's operators and steps need: the worker-admin token the operators
    send to worker pods, the base model in a folder process-node pods read, and the S3
    server holding the adapters."""

    worker_token: Path
    model: Path
    s3: S3Server


@dataclass(frozen=True)
class Space:
    """Where a run happens: the API, the namespace, and for LoRA scenarios their bed."""

    api: client.ApiClient
    namespace: str
    lora: LoraBed | None = None

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)


Step = Callable[[Space], Awaitable[Any]]


@dataclass(frozen=True)
class Target:
    """What a step converges to: `replicas` ready (None: the DynamoWorker is gone), that
    many worker pods, each with the adapter readiness gate (`gated`) or none, and per
    LoRAAdapter a source URI loaded on every ready pod, `GONE` or `WORKER_NOT_FOUND`."""

    replicas: int | None
    adapters: Mapping[str, str] = field(default_factory=dict)
    gated: bool = False

    @property
    def served(self) -> tuple[str, ...]:
        """The adapters every ready pod serves, and no other."""
        return tuple(sorted(n for n, want in self.adapters.items() if "://" in want))


@dataclass(frozen=True)
class Scenario:
    """`setup` runs under a fault-free operator and converges to `ready`; each of `steps`
    then runs under the fault and is followed by convergence to its target. `lora`: the
    run gets a `LoraBed` (the worker pods run on the process node)."""

    setup: tuple[Step, ...]
    ready: Target
    steps: tuple[tuple[Step, Target], ...]
    lora: bool = False


# -- convergence -------------------------------------------------------------------------


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


async def get_adapter(space: Space, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = await space.custom.get_namespaced_custom_object(
            GROUP, VERSION, space.namespace, ADAPTERS, name
        )
    except ApiException as err:
        if err.status != 404:
            raise
        return None
    return found


def _adapter_converged(adapter: dict[str, Any] | None, want: str, replicas: int | None) -> bool:
    if want == GONE or adapter is None:
        return want == GONE and adapter is None
    status = adapter.get("status") or {}
    if status.get("observedGeneration") != adapter["metadata"]["generation"]:
        return False
    if want == WORKER_NOT_FOUND:  # and no pod left in status (its pods are gone too)
        return condition(adapter, "Ready").get("reason") == WORKER_NOT_FOUND and not status.get(
            "pods"
        )
    pods = status.get("pods") or []
    return (
        condition(adapter, "Ready").get("reason") == "AllLoaded"
        and status.get("loaded") == f"{replicas}/{replicas}"
        and len(pods) == replicas
        and all(p["state"] == "Loaded" and p.get("uri") == want for p in pods)
    )


async def _converged(space: Space, target: Target) -> bool:
    try:
        worker = await get_worker(space.api, space.namespace, NAME)
    except ApiException as err:
        if err.status != 404:
            raise
        if target.replicas is not None or any(
            (await children(space.api, space.namespace, NAME)).values()
        ):
            return False
    else:
        if target.replicas is None or not is_ready(worker, target.replicas):
            return False
        pods = await worker_pods(space.api, space.namespace, NAME)
        if len(pods) != target.replicas or any(_gated(p) != target.gated for p in pods):
            return False
    for name, want in target.adapters.items():
        if not _adapter_converged(await get_adapter(space, name), want, target.replicas):
            return False
    return True


async def wait_converged(
    space: Space, target: Target, operator: OperatorProcess, within: float = CONVERGE_WITHIN
) -> None:
    try:
        await eventually(lambda: _converged(space, target), within, bool, every=0.3)
    except AssertionError as err:
        # The cluster's state first: a long operator log after it must not push it out of a
        # truncated report.
        state = await _state(space, target)
        raise AssertionError(
            f"convergence to {target}: {err}\nwhat the cluster held:\n{state}\n"
            f"operator log:\n{operator.log_tail(80)}"
        ) from None


async def _state(space: Space, target: Target) -> str:
    """The Deployment, each pod and each adapter, one line each: whether the operator, the
    Deployment controller or the node stalled is usually plain from it."""
    apps = client.AppsV1Api(space.api)
    lines = []
    for d in (await apps.list_namespaced_deployment(space.namespace)).items:
        st = d.status
        lines.append(
            f"Deployment {d.metadata.name} generation {d.metadata.generation} observed"
            f" {st.observed_generation}: replicas {st.replicas} updated {st.updated_replicas}"
            f" ready {st.ready_replicas} unavailable {st.unavailable_replicas}"
        )
    listing = await client.CoreV1Api(space.api).list_namespaced_pod(space.namespace)
    for p in listing.items:
        ready = {c.type: c.status for c in p.status.conditions or []}
        lines.append(
            f"pod {p.metadata.name} on {p.spec.node_name} phase {p.status.phase} conditions"
            f" {ready} deleting {p.metadata.deletion_timestamp is not None}"
        )
    for name in target.adapters:
        adapter = await get_adapter(space, name)
        lines.append(f"LoRAAdapter {name}: {None if adapter is None else adapter.get('status')}")
    return "\n".join(lines)


# -- what a run left ---------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a run left, in the terms the invariants compare."""

    status: dict[str, Any] | None  # None: the DynamoWorker is gone
    finalizers: tuple[str, ...]
    children: dict[str, int]
    replica_sets: int
    adapters: dict[str, dict[str, Any] | None]  # None: gone
    served: tuple[tuple[str, ...], ...]  # per ready worker pod, the adapters it serves


def _conditions(obj: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    found = (obj.get("status") or {}).get("conditions") or []
    return sorted((c["type"], c["status"], c.get("reason")) for c in found)


def _status_digest(worker: dict[str, Any]) -> dict[str, Any]:
    status = worker.get("status") or {}
    return {
        "conditions": _conditions(worker),
        "readyReplicas": status.get("readyReplicas"),
        "observedGeneration": status.get("observedGeneration"),
        "generation": worker["metadata"]["generation"],
    }


def _adapter_digest(adapter: dict[str, Any] | None) -> dict[str, Any] | None:
    """An adapter's status without pod names (they differ from run to run)."""
    if adapter is None:
        return None
    status = adapter.get("status") or {}
    return {
        "conditions": _conditions(adapter),
        "loaded": status.get("loaded"),
        "pods": sorted(
            (p["state"], p.get("reason"), p.get("uri")) for p in status.get("pods") or []
        ),
        "current": status.get("observedGeneration") == adapter["metadata"]["generation"],
        "finalizers": tuple(adapter["metadata"].get("finalizers") or ()),
    }


def _gated(pod: Any) -> bool:
    return any(g.condition_type == READINESS_GATE for g in pod.spec.readiness_gates or [])


def _ready(pod: Any) -> bool:
    conditions = pod.status.conditions or []
    return bool(pod.status.pod_ip) and any(
        c.type == "Ready" and c.status == "True" for c in conditions
    )


async def served_by_ready_pods(space: Space) -> tuple[tuple[str, ...], ...]:
    """What each ready worker pod serves (`GET /v1/loras` on its system port), sorted."""
    served = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for pod in await worker_pods(space.api, space.namespace, NAME):
            if not _ready(pod):
                continue
            url = f"http://{pod.status.pod_ip}:{SYSTEM_PORT}/v1/loras"
            async with session.get(url) as response:
                assert response.status == 200, f"{url}: {response.status}"
                served.append(tuple(sorted((await response.json())["loras"])))
    return tuple(sorted(served))


async def outcome(space: Space, target: Target) -> Outcome:
    api, namespace = space.api, space.namespace
    found = await children(api, namespace, NAME)
    replica_sets = await client.AppsV1Api(api).list_namespaced_replica_set(
        namespace, label_selector=f"dynamo.dev/worker={NAME}"
    )
    counts = {k: len(v) for k, v in found.items()}
    adapters = {n: _adapter_digest(await get_adapter(space, n)) for n in target.adapters}
    served = await served_by_ready_pods(space) if space.lora is not None else ()
    # Every targeted ready pod serves every adapter, and no other does.
    assert all(names == target.served for names in served), (served, target.served)
    try:
        worker = await get_worker(api, namespace, NAME)
    except ApiException as err:
        if err.status != 404:
            raise
        return Outcome(None, (), counts, len(replica_sets.items), adapters, served)
    uid = worker["metadata"]["uid"]
    for kind, objs in found.items():
        assert all(owned_by(o, uid) for o in objs), f"{kind} not owned by the DynamoWorker"
    return Outcome(
        _status_digest(worker),
        tuple(worker["metadata"].get("finalizers") or ()),
        counts,
        len(replica_sets.items),
        adapters,
        served,
    )


def violations(got: Outcome, baseline: Outcome) -> list[str]:
    """How `got` breaks the invariants against the run without the fault (empty: it does not)."""
    found = []
    if baseline.status is None:
        if got.status is not None:
            found.append("the DynamoWorker is still there (a finalizer stuck?)")
        if any(got.children.values()):
            found.append(f"children left: {got.children}")
    else:
        if got.children != baseline.children:
            found.append(f"duplicates or missing: {got.children}, not {baseline.children}")
        if got.finalizers != (FINALIZER,):
            found.append(f"finalizers {got.finalizers}, not ({FINALIZER},)")
        if got.status != baseline.status:
            found.append(f"status {got.status}, not {baseline.status}")
        if got.replica_sets > baseline.replica_sets:
            found.append(f"pods replaced that needed no replacing: {got.replica_sets} ReplicaSets")
    if got.adapters != baseline.adapters:
        found.append(f"adapters {got.adapters}, not {baseline.adapters}")
    if got.served != baseline.served:
        found.append(f"served {got.served}, not {baseline.served}")
    return found


async def settled_outcome(space: Space, target: Target, expected: Outcome | None) -> Outcome:
    """The outcome, read again while it breaks an invariant against `expected`, for up to
    `SETTLE_WITHIN`: convergence is judged by readiness, and a status write or an adapter's
    report may still be on its way then (after an apiserver restart, say)."""
    deadline = time.monotonic() + SETTLE_WITHIN
    while True:
        got = await outcome(space, target)
        if expected is None or not violations(got, expected) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(1)


def check_invariants(got: Outcome, baseline: Outcome) -> None:
    problems = violations(got, baseline)
    assert not problems, "\n".join(problems)


# -- operators ---------------------------------------------------------------------------


@dataclass
class Fleet:
    """The operators of one run and their proxies."""

    cluster: Cluster
    space: Space
    logs: Path
    started: list[tuple[OperatorProcess, ApiProxy, Any]]

    @property
    def base_args(self) -> tuple[str, ...]:
        lora = self.space.lora
        return () if lora is None else ("--worker-token-file", str(lora.worker_token))

    def start_behind(self, proxy: ApiProxy, name: str, *extra_args: str) -> OperatorProcess:
        return start_operator(
            self.cluster,
            [self.space.namespace],
            self.logs / f"{name}.log",
            kubeconfig=proxy.kubeconfig(self.logs / f"{name}.kubeconfig"),
            extra_args=(*self.base_args, *extra_args),
        )

    def start(self, *extra_args: str) -> tuple[OperatorProcess, ApiProxy]:
        index = len(self.started)
        proxy_cm = api_proxy(self.cluster.kubeconfig)
        proxy = proxy_cm.__enter__()
        operator = self.start_behind(proxy, f"operator-{index}", *extra_args)
        self.started.append((operator, proxy, proxy_cm))
        return operator, proxy

    def stop(self) -> None:
        for operator, _, proxy_cm in self.started:
            operator.stop()
            proxy_cm.__exit__(None, None, None)
        self.started.clear()


async def _idle_or_killed(
    operator: OperatorProcess, proxy: ApiProxy, done: Callable[[], Awaitable[bool]]
) -> bool:
    """True when the proxy killed the operator; False when it had no write to make (three
    reconciles, or the scenario's end state, without being killed)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proxy.killed:
            await operator.wait_exit(within=10)
            return True
        if operator.exited() is not None:
            raise AssertionError(f"the operator exited by itself:\n{operator.log_tail()}")
        try:
            idle = await asyncio.to_thread(operator.reconciles) >= 3 or await done()
        except OSError:
            idle = False  # not serving yet
        if idle and not proxy.killed:
            return False
        await asyncio.sleep(0.1)
    raise AssertionError(f"neither killed nor idle:\n{operator.log_tail()}")


def _kill(operator_box: list[OperatorProcess]) -> Callable[[], None]:
    return lambda: operator_box[0].process.send_signal(signal.SIGKILL)


async def run_step(fault: str, fleet: Fleet, step: Step, target: Target) -> None:
    space = fleet.space
    if fault == "none":
        operator, _, _ = fleet.started[-1]
        await step(space)
        await wait_converged(space, target, operator)
    elif fault == "kill-after-each-write":
        await step(space)
        for _ in range(MAX_KILLS):
            box: list[OperatorProcess] = []
            with api_proxy(fleet.cluster.kubeconfig) as proxy:
                proxy.kill_before_write(1, _kill(box))
                operator = fleet.start_behind(proxy, "killed")
                box.append(operator)
                try:
                    killed = await _idle_or_killed(
                        operator, proxy, lambda: _converged(space, target)
                    )
                finally:
                    operator.stop()
            if not killed:
                break
        else:
            raise AssertionError(f"still writing after {MAX_KILLS} kills")
        operator, _ = fleet.start()
        await wait_converged(space, target, operator)
    elif fault == "leader-killed":
        await step(space)
        leader = next(op for op, _, _ in fleet.started if op.exited() is None)
        leader.process.send_signal(signal.SIGKILL)
        await leader.wait_exit(within=10)
        fleet.start(*ELECTION_ARGS)
        survivor = next(op for op, _, _ in fleet.started if op.exited() is None)
        await wait_converged(space, target, survivor)
    elif fault == "apiserver-restart":
        operator, _, _ = fleet.started[-1]
        await step(space)
        # The real kube-apiserver of the test bed, stopped for OUTAGE_SECONDS and started
        # again (pytest runs one test at a time, so no other test is in flight). It returns
        # once the controller-manager and the scheduler act again: their reconnect is not
        # what the cell tests (it once stalled a roll past the convergence bound).
        restarted = await asyncio.to_thread(
            hack_cluster, "restart-apiserver", f"--down-seconds={OUTAGE_SECONDS}"
        )
        assert restarted.returncode == 0, restarted.stderr[-2000:]
        await wait_converged(space, target, operator)
        assert operator.exited() is None, "the operator died of the restart"
    elif fault == "watch-expired":
        operator, proxy, _ = fleet.started[-1]
        proxy.expire_watches(4)
        await step(space)
        await wait_converged(space, target, operator)
        assert proxy.expiring == 0, "the operator did not watch again"
    elif fault == "silent-watch":
        operator, proxy, _ = fleet.started[-1]
        assert proxy.silence_watches() >= 1
        await step(space)
        await wait_converged(space, target, operator, WATCH_INACTIVITY_SECONDS + CONVERGE_WITHIN)
    elif fault == "api-errors":
        operator, proxy, _ = fleet.started[-1]
        before = proxy.injected
        proxy.fail_next(8, 503)
        proxy.fail_next(8, 429)
        await step(space)
        await wait_converged(space, target, operator)
        assert proxy.injected - before == 16, proxy.injected - before
    else:
        raise AssertionError(fault)


async def _watching_dynamoworkers(fleet: Fleet) -> bool:
    proxy = fleet.started[-1][1]
    return any(r.watch and r.path.endswith("/dynamoworkers") for r in proxy.requests())


def _roles(fleet: Fleet) -> list[str]:
    roles = []
    for operator, _, _ in fleet.started:
        try:
            roles.append(operator.health()[1] if operator.exited() is None else "exited")
        except OSError:
            roles.append("down")
    return roles


def _check_no_write_by_a_non_leader(fleet: Fleet) -> None:
    """Each operator wrote only after its first Lease write."""
    for operator, proxy, _ in fleet.started:
        first_lease_write = next(
            (r.at for r in proxy.requests() if r.is_write and r.on_lease), None
        )
        writes = proxy.writes()
        if first_lease_write is None:
            assert writes == [], f"a standby wrote:\n{operator.log_tail()}"
        else:
            assert all(w.at >= first_lease_write for w in writes)


async def release_finalizers(api: client.ApiClient, namespace: str) -> None:
    """Strip what stopped operators would have removed, so the namespace can go."""
    custom = client.CustomObjectsApi(api)
    for plural in (ADAPTERS, PLURAL):
        with contextlib.suppress(ApiException):
            listing = await custom.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)
            for item in listing["items"]:
                await custom.patch_namespaced_custom_object(
                    GROUP, VERSION, namespace, plural, item["metadata"]["name"],
                    {"metadata": {"finalizers": None}}, **MERGE_PATCH,
                )  # fmt: skip


async def run_scenario(
    fault: str,
    scenario: Scenario,
    cluster: Cluster,
    space: Space,
    logs: Path,
    expected: Outcome | None = None,
) -> Outcome:
    """Run `scenario` under `fault`; what it left once converged, and, given the run without
    the fault (`expected`), once it matches that or `SETTLE_WITHIN` has passed."""
    fleet = Fleet(cluster, space, logs, [])
    try:
        if scenario.setup:
            operator, _ = fleet.start()
            for step in scenario.setup:
                await step(space)
            await wait_converged(space, scenario.ready, operator)
            fleet.stop()
        if fault == "leader-killed":
            # A leader first, then a standby: the one started first leads.
            fleet.start(*ELECTION_ARGS)
            await eventually(lambda: asyncio.to_thread(_roles, fleet), 30, ["leader"].__eq__)
            fleet.start(*ELECTION_ARGS)
            await eventually(
                lambda: asyncio.to_thread(_roles, fleet), 30, ["leader", "standby"].__eq__
            )
        elif fault != "kill-after-each-write":
            operator, _ = fleet.start()
            await operator.wait_serving()
            await eventually(lambda: _watching_dynamoworkers(fleet), 30, bool)
        for step, target in scenario.steps:
            await run_step(fault, fleet, step, target)
        if fault == "leader-killed":
            _check_no_write_by_a_non_leader(fleet)
        return await settled_outcome(space, scenario.steps[-1][1], expected)
    finally:
        fleet.stop()
        await release_finalizers(space.api, space.namespace)
