"""The KV-transfer monitor: vLLM's NixlConnector counters read from pods' /metrics (served over
real HTTP on loopback, written by prometheus-client as vLLM writes them), summed per role, and a
role's health turning Failing when a failed transfer or an expired request appears, and back
once the failure window has passed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from dynamo_operator.api.dynamoworker import DECODE, PREFILL, WorkerRole
from dynamo_operator.api.kv_transfer import FAILURE_WINDOW_SECONDS
from dynamo_operator.pods.load import KvTransferCounts, LoadReader, parse_pod
from dynamo_operator.reconcile.dynamoworker.kv_transfer import KvTransferMonitor
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def nixl_metrics(
    transfers: tuple[int, ...] = (),
    failed: int = 0,
    expired: int = 0,
    ranks: int = 1,
) -> str:
    """/metrics as vLLM writes its NixlConnector counters: per engine (rank), each pull's
    bytes and time, failures and expiries."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    xfer = Histogram("vllm:nixl_xfer_time_seconds", "", labels, registry=registry)
    moved = Histogram("vllm:nixl_bytes_transferred", "", labels, registry=registry)
    failures = Counter("vllm:nixl_num_failed_transfers", "", labels, registry=registry)
    expiries = Counter("vllm:nixl_num_kv_expired_reqs", "", labels, registry=registry)
    for rank in range(ranks):
        engine = ("m", str(rank))
        for size in transfers:
            xfer.labels(*engine).observe(0.01)
            moved.labels(*engine).observe(size)
        failures.labels(*engine).inc(failed)
        expiries.labels(*engine).inc(expired)
    return generate_latest(registry).decode()


def test_the_nixl_counters_parse_summed_over_ranks() -> None:
    reading = parse_pod(nixl_metrics((1000, 3000), failed=1, expired=2, ranks=2))
    assert reading.kv_transfer == KvTransferCounts(
        transfers=4, bytes_transferred=8000, failed_transfers=2, expired_requests=4
    )
    # A worker without the connector counts nothing.
    assert parse_pod("dynamo_component_inflight_requests 1\n").kv_transfer == KvTransferCounts()


@dataclass
class Pods:
    """Worker pods' /metrics on one loopback server, keyed by the pod's address."""

    texts: dict[str, str] = field(default_factory=dict)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.texts.get(request.query["pod"])
        if text is None:
            raise web.HTTPServiceUnavailable()
        return web.Response(text=text)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Pods, LoadReader]]:
    pods = Pods()
    app = web.Application()
    app.router.add_get("/metrics", pods.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            yield (
                pods,
                LoadReader(http, url_for=lambda ip: f"http://127.0.0.1:{port}/metrics?pod={ip}"),
            )
    finally:
        await runner.cleanup()


def pod(name: str, role: WorkerRole, uid: str | None = None) -> PodSummary:
    return PodSummary(
        name=name, uid=uid or f"uid-{name}", ip=name, ready=True, terminating=False, role=role
    )


async def test_a_new_failure_turns_its_role_failing_until_the_window_passes(
    served: tuple[Pods, LoadReader],
) -> None:
    pods, reader = served
    now = [T0]
    woken: list[str] = []
    monitor = KvTransferMonitor(
        reader, on_change=lambda ns, name: woken.append(name), clock=lambda: now[0]
    )
    workers = [pod("d1", DECODE), pod("d2", DECODE), pod("p1", PREFILL)]
    # Failures from before the operator started reading are counted, not flagged.
    pods.texts = {
        "d1": nixl_metrics((100,), failed=1),
        "d2": nixl_metrics((200, 300)),
        "p1": nixl_metrics(expired=1),
    }
    await monitor.step("ns", "llm", workers)
    view = monitor.view("ns", "llm")
    assert view is not None
    assert view[DECODE].model_dump() == {
        "health": "Healthy",
        "transfers": 3,
        "bytes_transferred": 600,
        "failed_transfers": 1,
        "expired_requests": 0,
        "pods_read": 2,
        "last_failure_time": None,
    }
    assert (view[PREFILL].health, view[PREFILL].expired_requests) == ("Healthy", 1)
    assert woken == ["llm"]

    # A pull fails on d2: the decode role is Failing, and the reconciler is woken at once.
    now[0] = T0 + timedelta(seconds=10)
    pods.texts["d2"] = nixl_metrics((200, 300), failed=1)
    await monitor.step("ns", "llm", workers)
    view = monitor.view("ns", "llm")
    assert view is not None
    assert (view[DECODE].health, view[DECODE].failed_transfers) == ("Failing", 2)
    assert view[DECODE].last_failure_time == now[0]
    assert view[PREFILL].health == "Healthy"
    assert woken == ["llm", "llm"]

    # The prefill pod restarted (its counters begin again) and one request already expired.
    now[0] = T0 + timedelta(seconds=20)
    workers[2] = pod("p1", PREFILL, uid="uid-p1-again")
    pods.texts["p1"] = nixl_metrics(expired=1)
    await monitor.step("ns", "llm", workers)
    view = monitor.view("ns", "llm")
    assert view is not None
    assert view[PREFILL].health == "Failing"

    # Nothing new for the whole window: both roles are Healthy again; an unreadable pod is
    # left out rather than counted.
    now[0] = T0 + timedelta(seconds=20 + FAILURE_WINDOW_SECONDS)
    del pods.texts["d1"]
    woken.clear()
    await monitor.step("ns", "llm", workers)
    view = monitor.view("ns", "llm")
    assert view is not None
    assert (view[DECODE].health, view[DECODE].pods_read) == ("Healthy", 1)
    assert view[PREFILL].health == "Healthy"
    assert woken == ["llm"]


async def test_counters_that_change_without_failures_are_shown_at_most_once_a_minute(
    served: tuple[Pods, LoadReader],
) -> None:
    pods, reader = served
    now = [T0]
    woken: list[datetime] = []
    monitor = KvTransferMonitor(
        reader, on_change=lambda ns, name: woken.append(now[0]), clock=lambda: now[0]
    )
    workers = [pod("d1", DECODE), pod("p1", PREFILL)]
    pods.texts = {"p1": nixl_metrics()}
    for step in range(8):
        now[0] = T0 + timedelta(seconds=10 * step)
        pods.texts["d1"] = nixl_metrics((100,) * (step + 1))
        await monitor.step("ns", "llm", workers)
    assert woken == [T0, T0 + timedelta(seconds=60)]
    view = monitor.view("ns", "llm")
    assert view is not None
    assert view[DECODE].transfers == 8
    monitor.forget("ns", "llm")
    assert monitor.view("ns", "llm") is None


async def test_a_role_without_a_ready_pod_is_unknown(served: tuple[Pods, LoadReader]) -> None:
    pods, reader = served
    monitor = KvTransferMonitor(reader, clock=lambda: T0)
    pods.texts = {"d1": nixl_metrics((100,))}
    unready = PodSummary(
        name="p1", uid="uid-p1", ip="p1", ready=False, terminating=False, role=PREFILL
    )
    await monitor.step("ns", "llm", [pod("d1", DECODE), unready])
    view = monitor.view("ns", "llm")
    assert view is not None
    assert (view[DECODE].health, view[PREFILL].health) == ("Healthy", "Unknown")
    assert view[PREFILL].pods_read == 0


async def test_a_pod_unreadable_at_the_first_step_is_taken_as_it_is_when_first_read(
    served: tuple[Pods, LoadReader],
) -> None:
    pods, reader = served
    now = [T0]
    monitor = KvTransferMonitor(reader, clock=lambda: now[0])
    workers = [pod("d1", DECODE), pod("p1", PREFILL)]
    pods.texts = {"p1": nixl_metrics()}  # d1 does not answer yet
    await monitor.step("ns", "llm", workers)
    # d1 answers with a failure from before the monitor looked: counted, not flagged.
    now[0] = T0 + timedelta(seconds=10)
    pods.texts["d1"] = nixl_metrics((100,), failed=1)
    await monitor.step("ns", "llm", workers)
    view = monitor.view("ns", "llm")
    assert view is not None
    assert (view[DECODE].health, view[DECODE].failed_transfers) == ("Healthy", 1)
    # A failure after that first read is news; so is one on a pod that came later.
    now[0] = T0 + timedelta(seconds=20)
    pods.texts["d1"] = nixl_metrics((100,), failed=2)
    pods.texts["p2"] = nixl_metrics(expired=1)
    await monitor.step("ns", "llm", [*workers, pod("p2", PREFILL)])
    view = monitor.view("ns", "llm")
    assert view is not None
    assert (view[DECODE].health, view[PREFILL].health) == ("Failing", "Failing")
