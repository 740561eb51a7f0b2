"""The control plane's CPU share on a saturated machine (hack/testbed/cpu_share.py): the API
server's p99 request latency while busy processes take every core, with the bed's share and
without it, in the same run.

The load: BURNERS busy-looping processes, four by default, what two CPU engines with two
threads each demand on 2 cores (two vLLM engines stepping flat out would do the same, and take
minutes to start). Meanwhile this test sends a steady stream of reads to the API server, and the
bed's controllers send their own.

- baseline: every bed process and every burner at the hierarchy's root, one weight each, as
  before the bed had groups;
- shares: the bed's processes in its system group, the burners in the pods' group, as the
  process node places its pods.

Latency is the API server's own (`apiserver_request_duration_seconds`, GET and LIST, from the
difference of its histogram over each window), so this test's own share of the CPU does not
count. Printed: p50 and p99 per window, and their ratios. Nothing is asserted.

Run: `.venv/bin/pytest tests/bench/bench_control_plane_share.py -m bench -s` (DYNAMO_BENCH_BURNERS,
DYNAMO_BENCH_WINDOW_SECONDS to change the load and the window).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from support.cluster import REPO, Cluster

sys.path.insert(0, str(REPO / "hack"))
from testbed import cpu_share, daemons
from testbed.layout import Layout

pytestmark = [pytest.mark.bench, pytest.mark.cluster]

BURNERS = int(os.environ.get("DYNAMO_BENCH_BURNERS", "4"))
WINDOW_SECONDS = float(os.environ.get("DYNAMO_BENCH_WINDOW_SECONDS", "30"))
READS_PER_SECOND = 10
VERBS = ("GET", "LIST")

Buckets = dict[float, float]


def _bed_pids() -> list[int]:
    layout = Layout.from_env()
    pids = (daemons.pid_of(layout, p.stem) for p in layout.pids.glob("*.pid"))
    return [pid for pid in pids if pid]


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the kubelet node's supervisor starts containerd, ...)."""
    found = [pid]
    for child in _children(pid):
        found += _process_tree(child)
    return found


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    children: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                children += [int(c) for c in listed.read().split()]
        except FileNotFoundError:
            continue
    return children


def _place_bed(group: cpu_share.CpuGroup | None) -> None:
    for daemon in _bed_pids():
        for pid in _process_tree(daemon):
            if group is None:
                cpu_share.release(pid)
            else:
                cpu_share.place(pid, group)


def _latency_buckets(cluster: Cluster) -> Buckets:
    """The API server's cumulative request-duration buckets, summed over GET and LIST."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    buckets: Buckets = defaultdict(float)
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("verb") in VERBS:
                buckets[float(sample.labels["le"])] += sample.value
    return buckets


def _quantile(before: Buckets, after: Buckets, q: float) -> float:
    """The upper bound of the bucket holding quantile `q` of the requests between the two."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q * total:
            return bound
    return bounds[-1]


@pytest.fixture
def burners() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def _window(
    cluster: Cluster, api: client.ApiClient, namespace: str
) -> tuple[float, float, float]:
    """p50, p99 and the request count over one window of steady reads."""
    core = client.CoreV1Api(api)
    before = _latency_buckets(cluster)
    deadline = time.monotonic() + WINDOW_SECONDS
    while time.monotonic() < deadline:
        await core.list_namespaced_config_map(namespace)
        await asyncio.sleep(1 / READS_PER_SECOND)
    after = _latency_buckets(cluster)
    count = after[float("inf")] - before.get(float("inf"), 0.0)
    return _quantile(before, after, 0.5), _quantile(before, after, 0.99), count


async def test_api_server_latency_with_and_without_the_control_planes_share(
    testbed: Cluster, api: client.ApiClient, namespace: str, burners: list[subprocess.Popen[bytes]]
) -> None:
    assert cpu_share.available() is None, cpu_share.available()
    try:
        _place_bed(None)
        for proc in burners:
            cpu_share.release(proc.pid)
        base50, base99, base_n = await _window(testbed, api, namespace)
        _place_bed(cpu_share.SYSTEM)
        for proc in burners:
            cpu_share.place(proc.pid, cpu_share.PODS)
        share50, share99, share_n = await _window(testbed, api, namespace)
    finally:
        _place_bed(cpu_share.SYSTEM)
    print(
        f"\nAPI server GET/LIST latency, {BURNERS} busy processes on {os.cpu_count()} cores, "
        f"{WINDOW_SECONDS:.0f} s windows (bucket upper bounds)\n"
        f"  no share (one weight each): p50 {base50 * 1000:.0f} ms, p99 {base99 * 1000:.0f} ms "
        f"({base_n:.0f} requests)\n"
        f"  the bed's share:            p50 {share50 * 1000:.0f} ms, p99 {share99 * 1000:.0f} ms "
        f"({share_n:.0f} requests)\n"
        f"  p99 ratio (share / none): {share99 / base99:.2f}"
    )
