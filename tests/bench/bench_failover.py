"""Failover figures on the test bed (run with `-m bench`): two operators with leader election
(the chart's defaults: a 15 s Lease, renewed every 2 s) and one DynamoWorker.

* killed: the leader is SIGKILLed; the time until the standby's first reconcile (its
  DynamoWorker reconcile count leaves 0). Bounded by the Lease duration plus a retry
  period and kopf's start; printed as a ratio to the Lease duration.
* stepped down: the leader gets SIGTERM (what a rolling update or a drain sends) and
  releases the Lease; the same time, as a ratio to the retry period.

Each round starts a fresh standby in place of the stopped leader, so two operators always run.
Prints the median and worst of DYNAMO_BENCH_FAILOVERS rounds (10) of each; asserts only that
every handover happened within the Lease duration plus slack.

* helm upgrade: the chart's two replicas on the process node, rolled by `helm upgrade` while
  the DynamoWorker changes again and again; the longest wait from a change to its reconcile
  (observedGeneration), against the same without an upgrade. It must stay under the Lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from support.cluster import Cluster, eventually
from support.dynamo_workers import (
    GROUP,
    PLURAL,
    VERSION,
    crds,
    create_worker,
    get_worker,
    wait_ready,
)
from support.helm import CHART, require_helm, run_helm
from support.operator_process import OperatorProcess, start_operator

pytestmark = pytest.mark.bench
__all__ = ["crds"]

ROUNDS = int(os.environ.get("DYNAMO_BENCH_FAILOVERS", "10"))
LEASE_SECONDS, RETRY_SECONDS = 15.0, 2.0
MERGE: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


def _role(operator: OperatorProcess) -> str:
    try:
        status, body = operator.health()
    except OSError:
        return "down"
    return body if status == 200 else str(status)


def _start(cluster: Cluster, namespace: str, log: Path) -> OperatorProcess:
    return start_operator(
        cluster,
        [namespace],
        log,
        resync_seconds=30.0,
        extra_args=[
            "--leader-election",
            f"--lease-duration-seconds={LEASE_SECONDS}",
            f"--lease-retry-seconds={RETRY_SECONDS}",
        ],
    )


async def _handover(
    leader: OperatorProcess, standby: OperatorProcess, how: signal.Signals
) -> float:
    """Seconds from signalling the leader to the standby's first finished reconcile."""
    assert standby.reconciles() == 0
    sent = time.monotonic()
    leader.process.send_signal(how)
    while standby.reconciles() == 0:
        assert time.monotonic() - sent < LEASE_SECONDS + 30, standby.log_tail()
        await asyncio.sleep(0.02)
    return time.monotonic() - sent


async def test_failover_times(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    operators = [_start(cluster, namespace, tmp_path / "op-0.log")]
    try:
        await operators[0].wait_serving()
        await eventually(lambda: asyncio.to_thread(_role, operators[0]), 30, "leader".__eq__)
        await create_worker(api, namespace, "bench")
        await wait_ready(api, namespace, "bench", 2)
        times: dict[str, list[float]] = {"killed": [], "stepped down": []}
        for i in range(2 * ROUNDS):
            how = signal.SIGKILL if i < ROUNDS else signal.SIGTERM
            standby = _start(cluster, namespace, tmp_path / f"op-{i + 1}.log")
            operators.append(standby)
            await standby.wait_serving()
            assert _role(standby) == "standby", standby.log_tail()
            leader = operators[-2]
            took = await _handover(leader, standby, how)
            times["killed" if how is signal.SIGKILL else "stepped down"].append(took)
            await leader.wait_exit(within=30)
    finally:
        for operator in operators:
            operator.stop()
    baseline = {"killed": LEASE_SECONDS, "stepped down": RETRY_SECONDS}
    print(f"\nfailover, leader -> standby's first reconcile ({ROUNDS} rounds each):")
    for name, values in times.items():
        median, worst = statistics.median(values), max(values)
        print(
            f"  {name:13s} median {median:6.2f} s  worst {worst:6.2f} s  "
            f"({median / baseline[name]:.2f}x / {worst / baseline[name]:.2f}x the "
            f"{'Lease duration' if name == 'killed' else 'retry period'}, {baseline[name]:g} s)"
        )
    assert max(times["killed"]) < LEASE_SECONDS + 3 * RETRY_SECONDS + 10


async def _observed_lags(
    api: client.ApiClient, namespace: str, name: str, until: Callable[[], bool]
) -> list[float]:
    """Change the DynamoWorker (replicas 2 <-> 3) again and again until `until()`; for each
    change, the seconds until its status says it was reconciled (observedGeneration)."""
    custom = client.CustomObjectsApi(api)
    lags, replicas = [], 2
    while not until():
        replicas = 5 - replicas
        changed = await custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}}, **MERGE
        )
        generation, sent = changed["metadata"]["generation"], time.monotonic()
        while True:
            worker = await get_worker(api, namespace, name)
            if (worker.get("status") or {}).get("observedGeneration", 0) >= generation:
                break
            assert time.monotonic() - sent < 120, "no reconcile for 2 minutes"
            await asyncio.sleep(0.05)
        lags.append(time.monotonic() - sent)
    return lags


async def test_reconcile_gap_during_helm_upgrade(
    api: client.ApiClient, cluster: Cluster, crds: None, tmp_path: Path
) -> None:
    """The chart's two replicas on the process node; `helm upgrade` rolls them (a changed pod
    annotation) while the DynamoWorker is changed over and over: the longest wait for a
    reconcile during the upgrade, against the longest in the same time without one."""
    if not cluster.is_testbed:
        pytest.skip("runs the chart's operator on the test bed's process node")
    helm = require_helm()
    release = f"gap-{uuid.uuid4().hex[:6]}"
    home, watched = f"{release}-home", f"{release}-watched"
    for namespace in (home, watched):
        cluster.kubectl("create", "namespace", namespace)
        cluster.kubectl("label", "namespace", namespace, "dynamo.dev/test=true")
    values = {
        "rbac": {"scope": "namespaced", "watchNamespaces": [watched]},
        "workerDefaults": {"image": "registry.invalid/dynamo-worker:bench"},
        "nodeSelector": {"dynamo.dev/node-kind": "process"},
        "tolerations": [
            {"key": "dynamo.dev/process-node", "operator": "Exists", "effect": "NoSchedule"}
        ],
    }
    values_file = tmp_path / "values.json"
    values_file.write_text(json.dumps(values))

    def helm_(*args: str) -> None:
        run_helm(helm, *args, "-n", home, "-f", str(values_file), kubeconfig=cluster.kubeconfig)

    try:
        helm_("install", release, str(CHART), "--take-ownership", "--wait", "--timeout", "180s")
        await create_worker(api, watched, "gap")
        await wait_ready(api, watched, "gap", 2, within=120)
        window = time.monotonic() + 30
        steady = await _observed_lags(api, watched, "gap", lambda: time.monotonic() > window)
        upgrade = asyncio.create_task(
            asyncio.to_thread(
                helm_, "upgrade", release, str(CHART), "--set",
                f"podAnnotations.rolled={uuid.uuid4().hex}", "--wait", "--timeout", "180s",
            )
        )  # fmt: skip
        during = await _observed_lags(api, watched, "gap", upgrade.done)
        await upgrade
    finally:
        run_helm(
            helm, "uninstall", release, "-n", home, "--wait", kubeconfig=cluster.kubeconfig,
            check=False,
        )  # fmt: skip
        cluster.kubectl(
            "patch", "dynamoworker", "gap", "-n", watched, "--type=merge",
            "-p", '{"metadata":{"finalizers":null}}', check=False,
        )  # fmt: skip
        for namespace in (home, watched):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    print(
        f"\nreconcile gap, change -> observedGeneration ({len(steady)} changes steady, "
        f"{len(during)} during `helm upgrade` of 2 replicas):\n"
        f"  steady   median {statistics.median(steady):5.2f} s  worst {max(steady):5.2f} s\n"
        f"  upgrade  median {statistics.median(during):5.2f} s  worst {max(during):5.2f} s  "
        f"({max(during) / max(steady):.1f}x steady's worst; the Lease is {LEASE_SECONDS:g} s)"
    )
    assert max(during) < LEASE_SECONDS, "a reconcile gap longer than the Lease duration"
