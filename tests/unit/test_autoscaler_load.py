"""Reading pods' load: the worker runtime's own /metrics parsed, the TTFT p90 between two
reads, and the reader's bounded concurrency and timeouts over real HTTP on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from dynamo_operator.pods.load import (
    LoadReader,
    parse_activator,
    parse_pod,
    ttft_p90,
)

BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5)


def worker_metrics(in_flight: list[float], kv: list[float], ttfts: list[float]) -> str:
    """/metrics as a worker writes it: in-flight per endpoint, KV use per rank, TTFT."""
    registry = CollectorRegistry()
    inflight = Gauge(
        "dynamo_component_inflight_requests", "", ["dynamo_endpoint"], registry=registry
    )
    for i, value in enumerate(in_flight):
        inflight.labels(f"e{i}").set(value)
    usage = Gauge("dynamo_component_gpu_cache_usage_percent", "", ["dp_rank"], registry=registry)
    for rank, value in enumerate(kv):
        usage.labels(str(rank)).set(value)
    ttft = Histogram(
        "dynamo_worker_time_to_first_token_seconds",
        "",
        ["model"],
        buckets=BUCKETS,
        registry=registry,
    )
    for value in ttfts:
        ttft.labels("m").observe(value)
    return generate_latest(registry).decode()


def test_a_workers_metrics_parse_to_its_load() -> None:
    reading = parse_pod(worker_metrics([2, 3], [0.5, 0.25], [0.2, 0.2, 3.0]))
    assert reading.in_flight == 5
    assert reading.kv_cache_percent == pytest.approx(37.5)
    counts = dict(reading.ttft_buckets)
    assert counts[0.25] == 2
    assert counts[float("inf")] == 3


def test_a_pod_without_kv_metrics_has_no_kv_reading() -> None:
    assert parse_pod(worker_metrics([1], [], [])).kv_cache_percent is None


def test_activator_metrics() -> None:
    text = "dynamo_activator_held_requests 3\ndynamo_activator_card_ready 1\n"
    reading = parse_activator(text)
    assert (reading.held, reading.card_ready) == (3, True)
    assert not parse_activator("dynamo_activator_held_requests 0\n").card_ready


def test_ttft_p90_counts_only_requests_between_reads() -> None:
    before = {"a": parse_pod(worker_metrics([0], [], [2.0] * 50)).ttft_buckets}
    # 10 new requests on pod a, all fast; pod b is new with 10 fast ones.
    after = {
        "a": parse_pod(worker_metrics([0], [], [2.0] * 50 + [0.05] * 10)).ttft_buckets,
        "b": parse_pod(worker_metrics([0], [], [0.05] * 10)).ttft_buckets,
    }
    p90 = ttft_p90(before, after)
    assert p90 is not None
    assert p90 <= 0.1  # the 50 slow ones of earlier do not count
    assert ttft_p90(after, after) is None  # nothing new


def test_ttft_p90_interpolates_within_its_bucket() -> None:
    after = {"a": parse_pod(worker_metrics([0], [], [0.3] * 10)).ttft_buckets}
    p90 = ttft_p90({}, after)
    assert p90 == pytest.approx(0.25 + 0.25 * 0.9)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_reads_are_bounded_and_time_out(http: aiohttp.ClientSession) -> None:
    """Twenty pods read with at most four connections at once; a pod that never answers
    costs one timeout and is left out."""
    active = peak = 0
    stall = asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        nonlocal active, peak
        if request.query.get("pod") == "stuck":
            await stall.wait()
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1
        return web.Response(text=worker_metrics([1], [0.1], []))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader = LoadReader(
            http,
            concurrency=4,
            timeout_seconds=0.5,
            url_for=lambda pod: f"http://127.0.0.1:{port}/metrics?pod={pod}",
        )
        readings = await asyncio.gather(*(reader.pod(f"p{i}") for i in range(20)))
        assert all(r is not None and r.in_flight == 1 for r in readings)
        assert peak == 4
        assert await reader.pod("stuck") is None
    finally:
        stall.set()
        await runner.cleanup()
