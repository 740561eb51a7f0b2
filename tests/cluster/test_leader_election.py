"""Two operators with `--leader-election` on the test bed: one leads, the other stands by.

Each operator talks to the API server through its own counting proxy
(`support.api_proxy`), so every request it sends, kopf's patches and Events included, is
counted at the server's door and attributed to it.

- One leads (health `leader`, metric 1), the other stands by and writes nothing, not even
  the Lease (at most the create it lost when both started and found none); killing the
  leader hands over within the Lease duration, the new leader reconciles, and an Event on
  the Lease says who took over from whom.
- A SIGSTOPped leader loses the Lease to the standby; resumed, it sends no write at all (the
  fencing rule) and exits to restart as a standby.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_operator.handlers.leadership import LEADERSHIP_LOST_EXIT_CODE
from support.api_proxy import ApiProxy, api_proxy
from support.cluster import Cluster, eventually
from support.dynamo_workers import GROUP, PLURAL, VERSION, create_worker, wait_ready
from support.operator_process import OperatorProcess, start_operator

pytestmark = pytest.mark.cluster

LEASE_SECONDS, RETRY_SECONDS = 4.0, 1.0
LEASE_NAME = "dynamo-operator-leader"
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
# Start-up (imports, the first Lease read) plus a full Lease and a retry of slack.
HANDOVER_WITHIN = 20 + LEASE_SECONDS + 2 * RETRY_SECONDS


def role(operator: OperatorProcess) -> str:
    try:
        status, body = operator.health()
    except OSError:
        return "down"
    return body if status == 200 else f"{status} {body}"


def leader_gauge(operator: OperatorProcess) -> float:
    return operator.metrics()[("dynamo_operator_leader", ())]


@contextmanager
def elected_operators(
    cluster: Cluster, namespace: str, tmp_path: Path, count: int
) -> Iterator[list[tuple[OperatorProcess, ApiProxy]]]:
    """`count` operators with leader election, each behind its own proxy."""
    with ExitStack() as stack:
        started: list[tuple[OperatorProcess, ApiProxy]] = []
        proxies = [stack.enter_context(api_proxy(cluster.kubeconfig)) for _ in range(count)]

        def stop_all() -> None:  # before the proxies close (the leader releases its Lease)
            for operator, _ in started:
                if operator.exited() is None:
                    operator.process.send_signal(signal.SIGCONT)
                operator.stop()

        stack.callback(stop_all)
        for i, proxy in enumerate(proxies):
            operator = start_operator(
                cluster,
                [namespace],
                tmp_path / f"operator-{i}.log",
                kubeconfig=proxy.kubeconfig(tmp_path / f"proxy-{i}.kubeconfig"),
                extra_args=[
                    "--leader-election",
                    f"--lease-duration-seconds={LEASE_SECONDS}",
                    f"--lease-retry-seconds={RETRY_SECONDS}",
                ],
            )
            started.append((operator, proxy))
        yield started


async def wait_role(operator: OperatorProcess, wanted: str, within: float) -> None:
    await operator.eventually(
        f"operator to be {wanted}", lambda: asyncio.to_thread(role, operator), within,
        lambda r: r == wanted,
    )  # fmt: skip


async def leader_then_standby(
    operators: list[tuple[OperatorProcess, ApiProxy]],
) -> list[tuple[OperatorProcess, ApiProxy]]:
    """Once one of the two leads and the other stands by: the leader's pair first."""
    await asyncio.gather(*(operator.wait_serving() for operator, _ in operators))
    roles = await eventually(
        lambda: asyncio.to_thread(lambda: [role(operator) for operator, _ in operators]),
        HANDOVER_WITHIN,
        lambda found: sorted(found) == ["leader", "standby"],
    )
    return sorted(operators, key=lambda pair: roles[operators.index(pair)] != "leader")


async def lease_holder(api: client.ApiClient, namespace: str) -> str:
    lease = await client.CoordinationV1Api(api).read_namespaced_lease(LEASE_NAME, namespace)
    return str(lease.spec.holder_identity)


def assert_only_a_lost_create(standby: ApiProxy, namespace: str) -> None:
    """The standby only reads the Lease. Started with the leader, it too found no Lease and
    may have sent one create, which lost the race (the API server takes one create and
    refuses the other with 409). Nothing else: no renew, no child, no status, no Event."""
    writes = standby.writes(leases=True)
    collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    assert len(writes) <= 1, writes
    assert all((w.method, w.path) == ("POST", collection) for w in writes), writes


async def leader_events(api: client.ApiClient, namespace: str) -> list[str]:
    # Read through core/v1 (the events.k8s.io model refuses kopf's Events without eventTime).
    events = await client.CoreV1Api(api).list_namespaced_event(namespace)
    return [
        str(e.message)
        for e in events.items
        if e.involved_object.kind == "Lease" and e.reason == "LeaderElected"
    ]


async def test_one_leads_the_standby_writes_nothing_and_a_killed_leader_hands_over(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    with elected_operators(cluster, namespace, tmp_path, 2) as operators:
        (a, proxy_a), (b, proxy_b) = await leader_then_standby(operators)
        first = await lease_holder(api, namespace)
        assert (leader_gauge(a), leader_gauge(b)) == (1, 0)
        assert_only_a_lost_create(proxy_b, namespace)

        await create_worker(api, namespace, "ha")
        await wait_ready(api, namespace, "ha", 2)
        assert proxy_a.writes(), "the leader reconciled"
        assert_only_a_lost_create(proxy_b, namespace)
        assert role(b) == "standby"

        a.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await wait_role(b, "leader", HANDOVER_WITHIN)
        took = time.monotonic() - killed
        assert took < LEASE_SECONDS + 3 * RETRY_SECONDS, took
        assert leader_gauge(b) == 1
        # The new leader reconciles: a scale reaches the Deployment.
        await client.CustomObjectsApi(api).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "ha", {"spec": {"replicas": 3}}, **MERGE_PATCH
        )
        await wait_ready(api, namespace, "ha", 3)
        assert proxy_b.writes(since=killed)
        second = await lease_holder(api, namespace)
        assert second != first
        notes = await eventually(lambda: leader_events(api, namespace), 10, lambda n: len(n) == 2)
        assert f"{second} became the leader (took over from {first})" in notes, notes


async def test_a_paused_leader_cannot_write_after_losing_the_lease(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    with elected_operators(cluster, namespace, tmp_path, 2) as operators:
        (a, proxy_a), (b, proxy_b) = await leader_then_standby(operators)
        await create_worker(api, namespace, "paused")
        await wait_ready(api, namespace, "paused", 2)

        a.process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        await wait_role(b, "leader", HANDOVER_WITHIN)
        # While the old leader sleeps, the spec changes: its watches queue the events, and its
        # resync loop is due, so it has writes to attempt once it runs again.
        await client.CustomObjectsApi(api).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "paused", {"spec": {"replicas": 3}}, **MERGE_PATCH
        )
        await wait_ready(api, namespace, "paused", 3)
        assert proxy_b.writes(since=stopped), "the new leader reconciled"

        resumed = time.monotonic()
        a.process.send_signal(signal.SIGCONT)
        code = await a.wait_exit(within=5 * RETRY_SECONDS + 10)
        assert code == LEADERSHIP_LOST_EXIT_CODE, a.log_tail()
        # Not one request that could change anything, not even a renew of the Lease.
        assert proxy_a.writes(since=resumed, leases=True) == [], a.log_tail()
        assert proxy_a.writes(since=stopped, leases=True) == []
        assert "lost the Lease" in a.log_tail()
        assert role(b) == "leader"
