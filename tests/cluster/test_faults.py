"""Fault injection on the test bed: each scenario under each fault, then the invariants.

Every operator talks to the API server through its own counting proxy (`support.api_proxy`),
so writes are counted where the server sees them, kopf's own patches (finalizer, progress
and last-handled annotations) and Events included, and each is attributed to its sender.

Faults:
- `kill-after-each-write`: each operator run is SIGKILLed right after its first write
  reaches the server (the proxy kills it when its second write arrives, and drops that one);
  a fresh run takes over, until one converges without being killed. Over the runs every write
  of the scenario's sequence is followed by a kill, so this is "killed after the k-th write,
  for every k" with the state each earlier kill left.
- `leader-killed`: two operators with leader election; the leader is SIGKILLed right after the
  scenario's change, while it reconciles it, and a fresh standby replaces it.
- `api-errors`: the API server (the proxy) answers bursts of 503 and of 429 with Retry-After to
  every request but watches, right after each change.
- `api-outage`: right after each change the API server is gone for `OUTAGE_SECONDS`, as the
  operator sees it (the proxy closes every connection and refuses new ones; the test bed's
  kube-apiserver is shared, so it is not really stopped).
- `watch-expired`: right before each change every connection is cut and the next watches
  get 410 Gone (an ERROR event with an Expired Status, what the API server sends once a
  resourceVersion is compacted away; injected by the proxy: the shared test bed's etcd is not
  compacted), so the operator must list again.
- `silent-watch`: right before each change, every watch stream open goes silent with its TCP
  connection alive (the proxy stops forwarding it); the operator notices through kopf's
  inactivity timeout (`WATCH_INACTIVITY_SECONDS`) and watches again.

Scenarios (a DynamoWorker on the fake GPU nodes): create it; edit its spec (rolls the pods);
scale 2 -> 4 -> 1; delete it.

Invariants after each run, against a run of the same scenario without the fault:
- exactly one child of each kind, owned by the DynamoWorker (none once it is deleted);
- the same status: conditions (status and reason), replica counts, observedGeneration;
- the finalizer once, or the object gone (no finalizer stuck);
- no more ReplicaSets than without the fault (no pod replaced that the scenario did not
  require);
- no write by a non-leader (leader election: a standby writes nothing before it leads).

CI runs the subset in `CI_SUBSET` (about 2 minutes); DYNAMO_FAULT_MATRIX=full runs every
scenario under every fault.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.handlers.lifecycle import WATCH_INACTIVITY_SECONDS
from support.api_proxy import ApiProxy, api_proxy
from support.cluster import Cluster, create_test_namespace, eventually
from support.dynamo_workers import (
    GROUP,
    PLURAL,
    VERSION,
    children,
    create_worker,
    get_worker,
    is_ready,
    owned_by,
)
from support.operator_process import OperatorProcess, start_operator

pytestmark = pytest.mark.cluster

NAME = "faulty"
FINALIZER = "dynamo.dev/finalizer"
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
LEASE_SECONDS, RETRY_SECONDS = 4.0, 1.0
ELECTION_ARGS = (
    "--leader-election",
    f"--lease-duration-seconds={LEASE_SECONDS}",
    f"--lease-retry-seconds={RETRY_SECONDS}",
)
CONVERGE_WITHIN = 90.0
OUTAGE_SECONDS = 8.0
MAX_KILLS = 40
FULL_MATRIX = os.environ.get("DYNAMO_FAULT_MATRIX") == "full"
Step = Callable[[client.ApiClient, str], Awaitable[Any]]


async def _patch(api: client.ApiClient, namespace: str, spec: dict[str, Any]) -> None:
    await client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, NAME, {"spec": spec}, **MERGE_PATCH
    )


async def _create(api: client.ApiClient, namespace: str) -> None:
    await create_worker(api, namespace, NAME)


async def _edit(api: client.ApiClient, namespace: str) -> None:
    await _patch(api, namespace, {"engine": {"extraArgs": ["--dtype", "bfloat16"]}})


async def _scale_to_4(api: client.ApiClient, namespace: str) -> None:
    await _patch(api, namespace, {"replicas": 4})


async def _scale_to_1(api: client.ApiClient, namespace: str) -> None:
    await _patch(api, namespace, {"replicas": 1})


async def _delete(api: client.ApiClient, namespace: str) -> None:
    await client.CustomObjectsApi(api).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, NAME
    )


@dataclass(frozen=True)
class Scenario:
    """`setup` runs under a fault-free operator; each of `steps` then runs under the fault and
    is followed by convergence to `replicas` ready (None: the DynamoWorker is gone)."""

    setup: tuple[Step, ...]
    steps: tuple[tuple[Step, int | None], ...]


SCENARIOS = {
    "create": Scenario((), ((_create, 2),)),
    "edit": Scenario((_create,), ((_edit, 2),)),
    "scale": Scenario((_create,), ((_scale_to_4, 4), (_scale_to_1, 1))),
    "delete": Scenario((_create,), ((_delete, None),)),
}
FAULTS = (
    "kill-after-each-write",
    "leader-killed",
    "api-errors",
    "api-outage",
    "watch-expired",
    "silent-watch",
)
CI_SUBSET = {
    ("create", "kill-after-each-write"),
    ("scale", "leader-killed"),
    ("edit", "api-errors"),
}


# -- convergence and invariants ------------------------------------------------------------


async def _converged(api: client.ApiClient, namespace: str, replicas: int | None) -> bool:
    try:
        worker = await get_worker(api, namespace, NAME)
    except ApiException as err:
        if err.status != 404:
            raise
        return replicas is None and not any((await children(api, namespace, NAME)).values())
    return replicas is not None and is_ready(worker, replicas)


async def wait_converged(
    api: client.ApiClient, namespace: str, replicas: int | None, operator: OperatorProcess
) -> None:
    await operator.eventually(
        f"the DynamoWorker to converge to {replicas} replicas",
        lambda: _converged(api, namespace, replicas),
        CONVERGE_WITHIN,
        bool,
    )


@dataclass(frozen=True)
class Outcome:
    """What a run left, in the terms the invariants compare."""

    status: dict[str, Any] | None  # None: the DynamoWorker is gone
    finalizers: tuple[str, ...]
    children: dict[str, int]
    replica_sets: int


def _status_digest(worker: dict[str, Any]) -> dict[str, Any]:
    status = worker.get("status") or {}
    return {
        "conditions": sorted(
            (c["type"], c["status"], c.get("reason")) for c in status.get("conditions") or []
        ),
        "readyReplicas": status.get("readyReplicas"),
        "observedGeneration": status.get("observedGeneration"),
        "generation": worker["metadata"]["generation"],
    }


async def outcome(api: client.ApiClient, namespace: str) -> Outcome:
    found = await children(api, namespace, NAME)
    replica_sets = await client.AppsV1Api(api).list_namespaced_replica_set(
        namespace, label_selector=f"dynamo.dev/worker={NAME}"
    )
    try:
        worker = await get_worker(api, namespace, NAME)
    except ApiException as err:
        if err.status != 404:
            raise
        return Outcome(None, (), {k: len(v) for k, v in found.items()}, len(replica_sets.items))
    uid = worker["metadata"]["uid"]
    for kind, objs in found.items():
        assert all(owned_by(o, uid) for o in objs), f"{kind} not owned by the DynamoWorker"
    return Outcome(
        _status_digest(worker),
        tuple(worker["metadata"].get("finalizers") or ()),
        {k: len(v) for k, v in found.items()},
        len(replica_sets.items),
    )


def check_invariants(got: Outcome, baseline: Outcome) -> None:
    if baseline.status is None:
        assert got.status is None, "the DynamoWorker is still there (a finalizer stuck?)"
        assert not any(got.children.values()), got.children
    else:
        assert got.children == dict.fromkeys(got.children, 1), f"duplicates: {got.children}"
        assert got.finalizers == (FINALIZER,), got.finalizers
        assert got.status == baseline.status
        assert got.replica_sets <= baseline.replica_sets, "pods replaced that needed no replacing"


# -- operators -----------------------------------------------------------------------------


@dataclass
class Fleet:
    """The operators of one run and their proxies."""

    cluster: Cluster
    namespace: str
    logs: Path
    started: list[tuple[OperatorProcess, ApiProxy, Any]]

    def start(self, *extra_args: str) -> tuple[OperatorProcess, ApiProxy]:
        index = len(self.started)
        proxy_cm = api_proxy(self.cluster.kubeconfig)
        proxy = proxy_cm.__enter__()
        operator = start_operator(
            self.cluster,
            [self.namespace],
            self.logs / f"operator-{index}.log",
            kubeconfig=proxy.kubeconfig(self.logs / f"proxy-{index}.kubeconfig"),
            extra_args=extra_args,
        )
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


async def run_step(
    fault: str, fleet: Fleet, api: client.ApiClient, step: Step, replicas: int | None
) -> None:
    namespace = fleet.namespace
    if fault == "none":
        operator, _, _ = fleet.started[-1]
        await step(api, namespace)
        await wait_converged(api, namespace, replicas, operator)
    elif fault == "kill-after-each-write":
        await step(api, namespace)
        for _ in range(MAX_KILLS):
            box: list[OperatorProcess] = []
            proxy_cm = api_proxy(fleet.cluster.kubeconfig)
            with proxy_cm as proxy:
                proxy.kill_before_write(1, _kill(box))
                operator = start_operator(
                    fleet.cluster,
                    [namespace],
                    fleet.logs / "killed.log",
                    kubeconfig=proxy.kubeconfig(fleet.logs / "killed.kubeconfig"),
                )
                box.append(operator)
                try:
                    killed = await _idle_or_killed(
                        operator, proxy, lambda: _converged(api, namespace, replicas)
                    )
                finally:
                    operator.stop()
            if not killed:
                break
        else:
            raise AssertionError(f"still writing after {MAX_KILLS} kills")
        operator, _ = fleet.start()
        await wait_converged(api, namespace, replicas, operator)
    elif fault == "leader-killed":
        await step(api, namespace)
        leader = next(op for op, _, _ in fleet.started if op.exited() is None)
        leader.process.send_signal(signal.SIGKILL)
        await leader.wait_exit(within=10)
        fleet.start(*ELECTION_ARGS)
        survivor = next(op for op, _, _ in fleet.started if op.exited() is None)
        await wait_converged(api, namespace, replicas, survivor)
    elif fault == "api-outage":
        operator, proxy, _ = fleet.started[-1]
        await step(api, namespace)
        proxy.outage(OUTAGE_SECONDS)
        await wait_converged(api, namespace, replicas, operator)
        assert operator.exited() is None, "the operator died of the outage"
    elif fault == "watch-expired":
        operator, proxy, _ = fleet.started[-1]
        proxy.expire_watches(4)
        await step(api, namespace)
        await wait_converged(api, namespace, replicas, operator)
        assert proxy.expiring == 0, "the operator did not watch again"
    elif fault == "silent-watch":
        operator, proxy, _ = fleet.started[-1]
        assert proxy.silence_watches() >= 1
        await step(api, namespace)
        await operator.eventually(
            f"the DynamoWorker to converge to {replicas} replicas past a silent watch",
            lambda: _converged(api, namespace, replicas),
            WATCH_INACTIVITY_SECONDS + CONVERGE_WITHIN,
            bool,
        )
    elif fault == "api-errors":
        operator, proxy, _ = fleet.started[-1]
        before = proxy.injected
        proxy.fail_next(8, 503)
        proxy.fail_next(8, 429)
        await step(api, namespace)
        await wait_converged(api, namespace, replicas, operator)
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


async def run_scenario(
    fault: str, scenario: Scenario, cluster: Cluster, api: client.ApiClient, namespace: str,
    logs: Path,
) -> Outcome:  # fmt: skip
    fleet = Fleet(cluster, namespace, logs, [])
    try:
        if scenario.setup:
            operator, _ = fleet.start()
            for step in scenario.setup:
                await step(api, namespace)
            await wait_converged(api, namespace, 2, operator)
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
        for step, replicas in scenario.steps:
            await run_step(fault, fleet, api, step, replicas)
        if fault == "leader-killed":
            # No write by a non-leader: each operator wrote only after its first Lease write.
            for operator, proxy, _ in fleet.started:
                requests = proxy.requests()
                first_lease_write = next(
                    (r.at for r in requests if r.is_write and r.on_lease), None
                )
                writes = proxy.writes()
                if first_lease_write is None:
                    assert writes == [], f"a standby wrote:\n{operator.log_tail()}"
                else:
                    assert all(w.at >= first_lease_write for w in writes)
        return await outcome(api, namespace)
    finally:
        fleet.stop()


_BASELINES: dict[str, Outcome] = {}


async def baseline(name: str, cluster: Cluster, api: client.ApiClient, logs: Path) -> Outcome:
    """The scenario without a fault (once per session), in a namespace of its own."""
    if name not in _BASELINES:
        namespace = await create_test_namespace(api, "baseline")
        try:
            _BASELINES[name] = await run_scenario(
                "none", SCENARIOS[name], cluster, api, namespace, logs
            )
        finally:
            await client.CoreV1Api(api).delete_namespace(namespace)
    return _BASELINES[name]


# Violations the matrix found and that are not fixed yet. kopf retries its own PATCH (the
# finalizer, added on create and removed on delete) 9 times over about 55 s; a burst that
# fails all 9 makes it give up until the object's next event, so the finalizer is missing
# when the DynamoWorker is Ready, or stays after it was deleted.
KNOWN_VIOLATIONS = {
    ("create", "api-errors"): "kopf's finalizer PATCH gives up within a 16-request burst",
    ("delete", "api-errors"): "kopf's finalizer removal gives up within a 16-request burst",
}


def _marks(scenario: str, fault: str) -> tuple[pytest.MarkDecorator, ...]:
    if not FULL_MATRIX and (scenario, fault) not in CI_SUBSET:
        return (pytest.mark.skip(reason="the full fault matrix: set DYNAMO_FAULT_MATRIX=full"),)
    if (scenario, fault) in KNOWN_VIOLATIONS:
        return (pytest.mark.xfail(reason=KNOWN_VIOLATIONS[(scenario, fault)], strict=False),)
    return ()


MATRIX = [
    pytest.param(scenario, fault, marks=_marks(scenario, fault), id=f"{scenario}-{fault}")
    for scenario in SCENARIOS
    for fault in FAULTS
]


@pytest.mark.parametrize(("scenario", "fault"), MATRIX)
async def test_scenario_under_fault_keeps_the_invariants(
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    crds: None,
    tmp_path: Path,
    scenario: str,
    fault: str,
) -> None:
    expected = await baseline(scenario, cluster, api, tmp_path)
    got = await run_scenario(fault, SCENARIOS[scenario], cluster, api, namespace, tmp_path)
    check_invariants(got, expected)
