"""The activator in front of a real `dynamo-worker` (tiny model, sample engine, loopback):
requests held at zero are answered once the worker is ready, exactly as the worker answers
them; a timeout is a clear error; a killed activator fails its held requests at once.

The activator runs in-process (or, to be killed, as a child process) with an in-memory pod
source fed from the worker's own `/metadata`: what the Kubernetes watches would report.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.activator.app import Activator
from dynamo.activator.config import ActivatorConfig
from dynamo.activator.pods import MemoryPodSource, ReadyPod, served_models, tcp_address
from dynamo.activator.presence import MemoryPresence
from support.tcp_frontend import CallHome, FakeFrontend
from support.tiny_model import TinyModel
from support.worker_process import SAMPLE_ENGINE, WorkerFactory, WorkerProcess, worker_factory

pytestmark = pytest.mark.e2e
__all__ = ["worker_factory"]

SERVED = "tiny-llama"
CONFIG = ActivatorConfig(
    worker="llama",
    pod_name="llama-activator-0",
    namespace="team-a",
    pod_uid="uid-a",
    pod_ip="127.0.0.1",
    http_port=0,
    system_port=0,
    bind_host="127.0.0.1",
)
CHAT = {
    "model": SERVED,
    "messages": [{"role": "user", "content": "Tell me about the weather"}],
    "max_tokens": 8,
    "stream": True,
}
TOKENS = {"token_ids": [40, 41, 42, 43], "stop_conditions": {"max_tokens": 6}, "model": SERVED}
CHILD = """
import asyncio, dataclasses, sys
from dynamo.activator.app import Activator
from dynamo.activator.config import ActivatorConfig
from dynamo.activator.pods import MemoryPodSource
from dynamo.activator.presence import MemoryPresence

async def main():
    config = ActivatorConfig(worker="llama", pod_name="act-0", namespace="ns", pod_uid="u",
        pod_ip="127.0.0.1", http_port=0, system_port=0, bind_host="127.0.0.1")
    activator = Activator(config, MemoryPodSource(), MemoryPresence())
    await activator.start()
    print("PORTS", activator.http_port, activator.tcp_port, activator.system_port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def start_worker(worker_factory: WorkerFactory, tiny_model: TinyModel) -> WorkerProcess:
    return worker_factory(
        "--engine",
        SAMPLE_ENGINE,
        "--model",
        str(tiny_model.base),
        "--served-model-name",
        SERVED,
        "--token-delay",
        "0.05",
        env={"DYN_REQUEST_PLANE": "tcp", "DYN_TCP_RPC_HOST": "127.0.0.1"},
    )


async def as_pod(worker: WorkerProcess, name: str = "llama-0") -> ReadyPod:
    """The worker as the pod watches would report it once it is Ready."""
    await worker.wait_health(200)
    async with (
        aiohttp.ClientSession() as session,
        session.get(worker.system_url() + "/metadata") as response,
    ):
        metadata = await response.json()
    return ReadyPod(
        name, worker.http_url(), tcp_address(metadata), served_models(metadata), metadata
    )


async def chat_events(url: str) -> tuple[int, list[Any], list[float]]:
    """A streamed chat completion: the status, its data events and when each arrived."""
    events: list[Any] = []
    arrivals: list[float] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=CHAT) as response,
    ):
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[len("data:") :].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
                arrivals.append(time.monotonic())
        return response.status, events, arrivals


def content(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    samples = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]
    return samples[0] if samples else 0.0


async def until(condition: Any, within: float = 30) -> None:
    """Poll a condition another process (or the activator's loop) changes."""
    async with asyncio.timeout(within):
        while not await condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


@pytest.fixture
async def activator() -> AsyncIterator[tuple[Activator, MemoryPodSource]]:
    source = MemoryPodSource()
    running = Activator(CONFIG, source, MemoryPresence())
    await running.start()
    yield running, source
    await running.stop()


async def send_tokens(front: FakeFrontend, port: int, path: str) -> CallHome:
    await front.connect(port)
    stream = front.expect()
    assert await front.send(front.frame(path, TOKENS, stream)) == [""]
    return stream


async def test_held_requests_are_answered_by_the_first_ready_pod_as_it_answers(
    activator: tuple[Activator, MemoryPodSource],
    worker_factory: WorkerFactory,
    tiny_model: TinyModel,
) -> None:
    running, source = activator
    url = f"http://127.0.0.1:{running.http_port}"
    system = f"http://127.0.0.1:{running.system_port}"
    # At zero: a streamed chat on the HTTP port and a token request on the TCP plane.
    chat = asyncio.create_task(chat_events(url))
    front = FakeFrontend()
    await front.start()
    held_stream = await send_tokens(front, running.tcp_port, "activator/any/path")

    async def both_held() -> bool:
        return await metric(system, "dynamo_activator_held_requests") == 2

    await until(both_held)

    async def handshake_arrived() -> bool:
        return held_stream.handshake is not None

    await until(handshake_arrived)  # called home at once; the prologue waits for a pod
    assert held_stream.prologue is None
    # Only now the worker starts; once it is ready the held requests go to it.
    worker = start_worker(worker_factory, tiny_model)
    source.set([await as_pod(worker)])
    status, events, arrivals = await asyncio.wait_for(chat, 60)
    await asyncio.wait_for(held_stream.closed.wait(), 60)
    await front.close()

    assert status == 200
    assert events[-1] == "[DONE]"
    # Streamed, not buffered: tokens come 50 ms apart and so do the events.
    assert arrivals[-1] - arrivals[0] > 0.2
    direct_status, direct, _ = await chat_events(worker.http_url())
    assert direct_status == 200
    assert content(events) == content(direct) != ""

    assert held_stream.prologue == {"error": None}
    assert held_stream.sentinel
    assert held_stream.complete_final
    direct_front = FakeFrontend()
    await direct_front.start()
    pod = await as_pod(worker)
    assert pod.tcp_address is not None
    hostport, _, path = pod.tcp_address.partition("/")
    direct_stream = await send_tokens(direct_front, int(hostport.rsplit(":", 1)[1]), path)
    await asyncio.wait_for(direct_stream.closed.wait(), 60)
    await direct_front.close()
    assert held_stream.token_ids() == direct_stream.token_ids() != []
    assert await metric(system, "dynamo_activator_forwarded_total") == 2
    assert await metric(system, "dynamo_activator_held_requests") == 0
    assert await metric(system, "dynamo_activator_wait_seconds_count") == 2


async def test_timeouts_are_503_on_http_and_unavailable_on_the_tcp_plane() -> None:
    source = MemoryPodSource()
    running = Activator(
        ActivatorConfig(**{**CONFIG.__dict__, "hold_timeout_s": 0.3}), source, MemoryPresence()
    )
    await running.start()
    front = FakeFrontend()
    try:
        await front.start()
        stream = await send_tokens(front, running.tcp_port, "any")
        status, _events, _ = await chat_events(f"http://127.0.0.1:{running.http_port}")
        await asyncio.wait_for(stream.closed.wait(), 10)
    finally:
        await front.close()
        await running.stop()
    assert status == 503
    assert stream.prologue == {"error": None}
    [item] = stream.items
    assert item["data"]["error"]["error_type"] == "Unavailable"
    assert "team-a/llama" in item["data"]["error"]["message"]
    assert stream.complete_final
    assert stream.sentinel
    assert running.metrics.registry.get_sample_value("dynamo_activator_expired_total") == 2


async def test_a_killed_activator_fails_its_held_requests_at_once() -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    front = FakeFrontend()
    try:
        assert child.stdout is not None
        line = (await asyncio.wait_for(child.stdout.readline(), 30)).decode()
        assert line.startswith("PORTS"), line
        http_port, tcp_port, system_port = (int(p) for p in line.split()[1:])
        system = f"http://127.0.0.1:{system_port}"
        await front.start()
        stream = await send_tokens(front, tcp_port, "any")
        chat = asyncio.create_task(chat_events(f"http://127.0.0.1:{http_port}"))

        async def both_held() -> bool:
            return await metric(system, "dynamo_activator_held_requests") == 2

        await until(both_held)
        killed_at = time.monotonic()
        child.kill()
        # The frontend's call-home stream ends without a prologue: upstream's frontend
        # answers 503 at once (observed); our HTTP client sees the connection drop.
        await asyncio.wait_for(stream.closed.wait(), 5)
        assert stream.handshake is not None
        assert stream.prologue is None
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(chat, 5)
        assert time.monotonic() - killed_at < 5
    finally:
        await front.close()
        if child.returncode is None:
            child.kill()
        await child.wait()
