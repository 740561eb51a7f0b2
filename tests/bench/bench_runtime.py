"""Worker runtime benchmarks with the sample engine (no model is measured).

Run: `.venv/bin/pytest -m bench -s tests/bench/bench_runtime.py`. Each prints figures with
a baseline measured in the same run; nothing is asserted about speed.

1. Overhead: 8 concurrent requests x 256 tokens at zero token delay, completion tokens/s
   through a real worker process's HTTP routes vs calling `generate` in-process, and how
   many tokens each of the worker's writes (HTTP chunks) carried on the streamed routes.
2. Drain: 5 streams of 40 tokens at 0.25 s/token, SIGTERM 3 s in, default shutdown
   settings: how many complete and how long the worker takes to exit.
3. `/metrics` scrape time with 100 LoRA adapters loaded vs none.
4. `/health` latency p99 while the worker streams at full speed vs idle.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dynamo.engines.sample import SampleEngine, SampleEngineArgs
from dynamo.runtime.context import Context
from support import bench_plots
from support.lora_adapters import adapter_files, write_tree
from support.worker_process import SAMPLE_ENGINE, WorkerFactory, worker_factory

pytestmark = pytest.mark.bench
__all__ = ["worker_factory"]

CONCURRENCY = 8
TOKENS = 256
ROUNDS = 10


async def in_process_rate() -> float:
    """Completion tokens/s calling `generate` directly (best of ROUNDS)."""
    engine = SampleEngine(SampleEngineArgs())
    await engine.start(1)

    async def one(index: int) -> int:
        request = {"token_ids": [1, index], "stop_conditions": {"max_tokens": TOKENS}}
        count = 0
        async for chunk in engine.generate(request, Context()):  # type: ignore[arg-type]
            count += len(chunk["token_ids"])
        return count

    best = 0.0
    try:
        for _ in range(ROUNDS):
            started = time.perf_counter()
            total = sum(await asyncio.gather(*(one(i) for i in range(CONCURRENCY))))
            best = max(best, total / (time.perf_counter() - started))
    finally:
        await engine.cleanup()
    return best


async def _tail(response: aiohttp.ClientResponse, writes: list[int]) -> bytes:
    """The whole body's last 4 KiB, read as it arrives without parsing it (the client stays
    cheap, so the figure measures the worker, not the benchmark); counts the HTTP chunks
    (one per write of the worker) into `writes`."""
    tail = b""
    async for piece, end_of_chunk in response.content.iter_chunks():
        tail = (tail + piece)[-4096:]
        writes[0] += end_of_chunk and bool(piece)
    return tail


async def http_rate(url: str, route: str) -> tuple[float, float]:
    """Completion tokens/s through one HTTP route (best of ROUNDS) and tokens per write;
    tokens are the usage the worker reports in its last chunk."""
    writes = [0]

    async def one(session: aiohttp.ClientSession, index: int) -> int:
        if route == "generate":
            body: dict[str, Any] = {
                "token_ids": [1, index],
                "stop_conditions": {"max_tokens": TOKENS},
            }
            async with session.post(url + "/v1/generate", json=body) as response:
                last = (await _tail(response, writes)).strip().rsplit(b"\n", 1)[-1]
                return int(json.loads(last)["completion_usage"]["completion_tokens"])
        body = {"prompt": f"p{index}", "max_tokens": TOKENS}
        if route == "sse":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url + "/v1/completions", json=body) as response:
            if route == "sse":
                events = (await _tail(response, writes)).strip().split(b"\n\n")
                usage = json.loads(events[-2].removeprefix(b"data: "))["usage"]
                return int(usage["completion_tokens"])
            return int((await response.json())["usage"]["completion_tokens"])

    best = 0.0
    tokens = 0
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        await one(session, 0)  # warm up the connection pool
        writes[0] = 0
        for _ in range(ROUNDS):
            started = time.perf_counter()
            total = sum(await asyncio.gather(*(one(session, i) for i in range(CONCURRENCY))))
            best = max(best, total / (time.perf_counter() - started))
            tokens += total
    return best, tokens / max(1, writes[0])


async def test_runtime_overhead(worker_factory: WorkerFactory) -> None:
    worker = worker_factory("--engine", SAMPLE_ENGINE)
    await worker.wait_health(200)
    url = worker.http_url()
    baseline = await in_process_rate()
    print(f"\n[overhead] {CONCURRENCY} x {TOKENS} tokens, zero delay")
    print(f"  in-process generate:             {baseline:10.0f} tokens/s (baseline)")
    rows = []
    for route, label in (
        ("generate", "/v1/generate (NDJSON stream)"),
        ("sse", "/v1/completions (SSE stream)"),
        ("unary", "/v1/completions (one response)"),
    ):
        rate, per_write = await http_rate(url, route)
        writes = f"  {per_write:5.1f} tokens/write" if route != "unary" else ""
        print(f"  {label:32s} {rate:10.0f} tokens/s  ratio {rate / baseline:.3f}{writes}")
        rows.append((label, rate))
    bench_plots.throughput(
        ("in-process generate (baseline)", baseline),
        rows,
        f"Worker HTTP overhead, {CONCURRENCY} x {TOKENS} tokens",
        "bench-runtime-overhead",
    )
    worker.terminate()
    await worker.wait_exit()


async def drain_stream(url: str, done: list[str], started: asyncio.Event) -> None:
    body = {"prompt": "drain", "max_tokens": 40, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        reason = "none"
        async for line in response.content:
            if line.startswith(b"data: {"):
                started.set()
                finish = json.loads(line[6:])["choices"][0]["finish_reason"]
                reason = finish or reason
        done.append(reason)


async def test_drain(worker_factory: WorkerFactory) -> None:
    worker = worker_factory(
        "--engine",
        SAMPLE_ENGINE,
        "--token-delay",
        "0.25",
        # The defaults: 5 s grace, 30 s drain timeout, 30 s hard deadline.
        env={"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "5"},
    )
    await worker.wait_health(200)
    url = worker.http_url() + "/v1/completions"
    reasons: list[str] = []
    starts = [asyncio.Event() for _ in range(5)]
    started_at = time.monotonic()
    streams = [asyncio.create_task(drain_stream(url, reasons, s)) for s in starts]
    await asyncio.gather(*(s.wait() for s in starts))
    await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - started_at)))
    signalled = time.monotonic()
    worker.terminate()
    code = await worker.wait_exit(120)
    exited = time.monotonic() - signalled
    await asyncio.gather(*streams)
    completed = reasons.count("length")
    print("\n[drain] 5 streams x 40 tokens at 0.25 s/token, SIGTERM 3 s in (defaults)")
    print(f"  completed {completed}/5 (finish reasons {sorted(reasons)}), exit code {code}")
    print(f"  exited {exited:.1f} s after the signal (goal 5/5; upstream: 0/5, ~5 s)")


async def test_metrics_scrape_with_adapters(worker_factory: WorkerFactory, tmp_path: Path) -> None:
    worker = worker_factory(
        "--engine", SAMPLE_ENGINE, "--max-loras", "100",
        env={"DYN_LORA_ENABLED": "true", "DYN_LORA_PATH": str(tmp_path / "cache")},
    )  # fmt: skip
    await worker.wait_health(200)
    system = worker.system_url()

    async def scrape_times(session: aiohttp.ClientSession, count: int = 200) -> list[float]:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            async with session.get(system + "/metrics") as response:
                await response.read()
            times.append(time.perf_counter() - started)
        return times

    async with aiohttp.ClientSession() as session:
        empty = await scrape_times(session)
        files = adapter_files(0)
        for index in range(100):
            path = write_tree(tmp_path / "adapters" / f"a{index}", files)
            body = {"lora_name": f"adapter-{index}", "source": {"uri": f"file://{path}"}}
            async with session.post(system + "/v1/loras", json=body) as response:
                assert response.status == 200, await response.text()
        loaded = await scrape_times(session)
        async with session.get(system + "/metrics") as response:
            size = len(await response.read())
    print("\n[/metrics] scrape time, 200 scrapes each")
    for label, times in (("no adapters (baseline)", empty), ("100 adapters", loaded)):
        print(
            f"  {label:24s} median {statistics.median(times) * 1e3:6.2f} ms  "
            f"p99 {percentile(times, 99) * 1e3:6.2f} ms"
        )
    ratio = statistics.median(loaded) / statistics.median(empty)
    print(f"  ratio (median) {ratio:.2f}; body {size} bytes with 100 adapters")
    worker.terminate()
    await worker.wait_exit()


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))
    return ordered[index]


async def test_health_latency_under_load(worker_factory: WorkerFactory) -> None:
    worker = worker_factory("--engine", SAMPLE_ENGINE)
    await worker.wait_health(200)
    system, http = worker.system_url(), worker.http_url()

    async def health_times(session: aiohttp.ClientSession, count: int = 300) -> list[float]:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            async with session.get(system + "/health") as response:
                await response.read()
            times.append(time.perf_counter() - started)
        return times

    async def load(stop: asyncio.Event, running: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                body = {"token_ids": [1], "stop_conditions": {"max_tokens": TOKENS}}
                async with session.post(http + "/v1/generate", json=body) as response:
                    await response.read()
                running.set()

    async with aiohttp.ClientSession() as session:
        idle = await health_times(session)
        stop = asyncio.Event()
        running = [asyncio.Event() for _ in range(CONCURRENCY)]
        loaders = [asyncio.create_task(load(stop, flag)) for flag in running]
        await asyncio.gather(*(flag.wait() for flag in running))  # every loader is busy
        busy = await health_times(session)
        stop.set()
        await asyncio.gather(*loaders)
    print(f"\n[/health] latency, 300 probes each ({CONCURRENCY} zero-delay streams as load)")
    for label, times in (("idle (baseline)", idle), ("under load", busy)):
        print(
            f"  {label:16s} median {statistics.median(times) * 1e3:6.2f} ms  "
            f"p99 {percentile(times, 99) * 1e3:6.2f} ms"
        )
    print(f"  p99 ratio {percentile(busy, 99) / percentile(idle, 99):.1f}")
    worker.terminate()
    await worker.wait_exit()
