"""`LoraClient` against the worker's own `/v1/loras` routes (`LoraRoutes` over a real
`LoRAAdapterHost` and `LoRAManager`, file:// adapters) on loopback servers, one per "pod":
answers and reasons, idempotent and hot-swap loads, shared lists, the concurrency bound and
timeouts, and request bodies that carry nothing but the adapter name and source."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from dynamo.common.lora import LoRAManager, adapter_digest
from dynamo.engines.lora_host import LoRAAdapterHost
from dynamo.runtime.system.admin import EngineRoutes
from dynamo.runtime.system.loras import LoraRoutes
from dynamo_operator.pods.adapters import LoraClient
from support.loopback_http import LoopbackHttpServer, serve
from support.lora_adapters import adapter_files, lora_env, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


@dataclass
class FakeEngine:
    """The engine callbacks; `gate` holds loads until set (to observe concurrency)."""

    gate: asyncio.Event | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    active: int = 0
    most_active: int = 0

    async def load(self, name: str, lora_id: int, path: Path) -> None:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        self.entered.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.active -= 1

    async def unload(self, name: str, lora_id: int) -> None:
        return None


@dataclass
class PodServer:
    """One pod's system server: the real routes, plus the raw bodies it received."""

    engine: FakeEngine
    host: LoRAAdapterHost
    bodies: list[Any] = field(default_factory=list)
    lists: int = 0
    delay_seconds: float = 0.0

    def app(self) -> web.Application:
        routes = EngineRoutes()
        for op in ("load_lora", "unload_lora", "list_loras"):
            routes.register(op, self._handler(op))
        app = web.Application(middlewares=[self._record])
        LoraRoutes(routes).add_to(app)
        return app

    def _handler(self, op: str) -> Any:
        async def handle(body: Any) -> dict[str, Any]:
            return await self.host.handle(op, body)

        return handle

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "GET":
            self.lists += 1
        raw = await request.read()
        self.bodies.append(json.loads(raw) if raw else None)
        await asyncio.sleep(self.delay_seconds)
        return await handler(request)


@dataclass
class Pods:
    servers: dict[str, PodServer]
    addresses: dict[str, LoopbackHttpServer]

    def url_for(self, ip: str, path: str) -> str:
        return self.addresses[ip].url(path)


@pytest_asyncio.fixture
async def pods(lora_env: Path) -> AsyncIterator[Pods]:
    async with AsyncExitStack() as stack:
        servers, addresses = {}, {}
        for ip in ("198.18.1.2", "198.18.1.3"):
            engine = FakeEngine()
            host = LoRAAdapterHost(
                max_loras=1, load=engine.load, unload=engine.unload, manager=LoRAManager()
            )
            server = PodServer(engine, host)
            servers[ip] = server
            addresses[ip] = await stack.enter_async_context(serve(server.app()))
        yield Pods(servers, addresses)


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


def adapter(root: Path, name: str, seed: int) -> Path:
    return write_tree(root / "adapters" / name, adapter_files(seed))


async def test_load_list_hot_swap_and_unload(
    pods: Pods, session: aiohttp.ClientSession, lora_env: Path
) -> None:
    client = LoraClient(session, url_for=pods.url_for)
    v1, v2 = adapter(lora_env, "v1", 1), adapter(lora_env, "v2", 2)
    assert (await client.list("198.18.1.2")).loras == {}

    loaded = await client.load("198.18.1.2", "sql", f"file://{v1}", adapter_digest(v1))
    assert loaded.ok
    assert loaded.lora_id is not None
    listing = await client.list("198.18.1.2")  # the load dropped the cached answer
    assert listing.loras == {"sql": loaded.lora_id}
    # Where it came from, so that a restarted operator can tell without loading it again.
    assert listing.sources == {"sql": (f"file://{v1}", adapter_digest(v1))}
    again = await client.load("198.18.1.2", "sql", f"file://{v1}", None)
    assert again.ok
    assert "already loaded" in again.message
    swapped = await client.load("198.18.1.2", "sql", f"file://{v2}", None)
    assert swapped.ok
    assert pods.servers["198.18.1.2"].host.loaded()["sql"].uri == f"file://{v2}"

    assert (await client.unload("198.18.1.2", "sql")).ok
    gone = await client.unload("198.18.1.2", "sql")
    assert (gone.ok, gone.reason) == (False, "NotLoaded")
    assert (await client.list("198.18.1.2")).loras == {}
    # The other pod saw nothing.
    assert pods.servers["198.18.1.3"].bodies == []


async def test_failures_carry_camel_case_reasons(
    pods: Pods, session: aiohttp.ClientSession, lora_env: Path
) -> None:
    client = LoraClient(session, url_for=pods.url_for)
    v1, other = adapter(lora_env, "v1", 1), adapter(lora_env, "other", 9)
    wrong = await client.load("198.18.1.2", "sql", f"file://{v1}", adapter_digest(other))
    assert (wrong.ok, wrong.reason) == (False, "DigestMismatch")
    assert "digest mismatch" in wrong.message
    missing = await client.load("198.18.1.2", "sql", f"file://{lora_env}/nowhere", None)
    assert (missing.ok, missing.reason) == (False, "SourceNotFound")
    assert (await client.load("198.18.1.2", "a", f"file://{v1}", None)).ok
    full = await client.load("198.18.1.2", "b", f"file://{other}", None)
    assert (full.ok, full.reason) == (False, "CapacityExceeded")
    assert full.message.startswith("LoRA capacity exceeded")


async def test_request_bodies_hold_only_the_name_and_source(
    pods: Pods, session: aiohttp.ClientSession, lora_env: Path
) -> None:
    client = LoraClient(session, url_for=pods.url_for)
    v1 = adapter(lora_env, "v1", 1)
    digest = adapter_digest(v1)
    await client.load("198.18.1.2", "sql", f"file://{v1}", digest)
    await client.load("198.18.1.3", "sql", f"file://{v1}", None)
    assert pods.servers["198.18.1.2"].bodies == [
        {"lora_name": "sql", "source": {"uri": f"file://{v1}", "sha256": digest}}
    ]
    assert pods.servers["198.18.1.3"].bodies == [
        {"lora_name": "sql", "source": {"uri": f"file://{v1}"}}
    ]


async def test_concurrent_lists_of_a_pod_share_one_request(
    pods: Pods, session: aiohttp.ClientSession
) -> None:
    server = pods.servers["198.18.1.2"]
    server.delay_seconds = 0.2
    client = LoraClient(session, url_for=pods.url_for, cache_seconds=0.0)
    answers = await asyncio.gather(*(client.list("198.18.1.2") for _ in range(10)))
    assert {len(a.loras or {}) for a in answers} == {0}
    assert server.lists == 1


def gate_loads(pods: Pods) -> asyncio.Event:
    gate, entered = asyncio.Event(), asyncio.Event()
    for server in pods.servers.values():
        server.engine.gate = gate
        server.engine.entered = entered
        server.host = LoRAAdapterHost(
            max_loras=8, load=server.engine.load, unload=server.engine.unload, manager=LoRAManager()
        )
    return gate


async def test_loads_are_bounded_per_pod(
    pods: Pods, session: aiohttp.ClientSession, lora_env: Path
) -> None:
    gate = gate_loads(pods)
    client = LoraClient(session, url_for=pods.url_for, loads_per_pod=2)
    sources = [adapter(lora_env, f"a{i}", i) for i in range(4)]
    loads = asyncio.gather(
        *(
            client.load(ip, f"a{i}", f"file://{path}", None)
            for i, path in enumerate(sources)
            for ip in ("198.18.1.2", "198.18.1.3")
        )
    )
    engines = [s.engine for s in pods.servers.values()]

    # Both pods load at once, each up to its own bound.
    entered = pods.servers["198.18.1.2"].engine.entered
    while sum(e.active for e in engines) < 4:
        await entered.wait()
        entered.clear()
    # Lists are not held up by the loads in flight.
    assert (await client.list("198.18.1.2")).loras == {}
    await asyncio.sleep(0.2)
    assert [e.active for e in engines] == [2, 2]
    gate.set()
    results = await loads
    assert all(r.ok for r in results)
    assert [e.most_active for e in engines] == [2, 2]


async def test_a_stuck_load_gives_its_pods_slot_up_after_load_slot_seconds(
    pods: Pods, session: aiohttp.ClientSession, lora_env: Path
) -> None:
    gate = gate_loads(pods)
    client = LoraClient(session, url_for=pods.url_for, load_slot_seconds=0.5)  # 1 per pod
    engine = pods.servers["198.18.1.2"].engine
    stuck = asyncio.create_task(
        client.load("198.18.1.2", "stuck", f"file://{adapter(lora_env, 'stuck', 1)}", None)
    )
    await engine.entered.wait()
    engine.entered.clear()
    started = time.monotonic()
    second = asyncio.create_task(
        client.load("198.18.1.2", "next", f"file://{adapter(lora_env, 'next', 2)}", None)
    )
    # The next load waits for the slot while the stuck one holds it, then goes out beside it.
    await engine.entered.wait()
    assert time.monotonic() - started >= 0.4
    assert engine.active == 2
    gate.set()
    assert all(r.ok for r in await asyncio.gather(stuck, second))
    assert engine.most_active == 2


async def test_a_load_that_takes_too_long_times_out(
    pods: Pods, session: aiohttp.ClientSession, lora_env: Path
) -> None:
    gate_loads(pods)
    client = LoraClient(session, url_for=pods.url_for, load_timeout_seconds=0.3)
    path = adapter(lora_env, "slow", 1)
    result = await client.load("198.18.1.2", "slow", f"file://{path}", None)
    assert (result.ok, result.reason) == (False, "RequestTimeout")
    assert result.message == "no answer within 0.3s"


async def test_an_unreachable_pod_and_a_pod_without_lora_routes(
    session: aiohttp.ClientSession,
) -> None:
    async with serve(web.Application()) as bare:
        client = LoraClient(session, url_for=lambda ip, path: bare.url(path))
        listing = await client.list("198.18.1.9")
        assert (listing.loras, listing.reason) == (None, "LoRADisabled")
    # The server is gone: connection refused.
    client = LoraClient(session, url_for=lambda ip, path: bare.url(path))
    listing = await client.list("198.18.1.9")
    assert (listing.loras, listing.reason) == (None, "WorkerUnreachable")
    result = await client.unload("198.18.1.9", "sql")
    assert (result.ok, result.reason) == (False, "WorkerUnreachable")


async def test_a_silent_pod_times_out_quickly(session: aiohttp.ClientSession) -> None:
    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    async with serve(app) as silent:
        client = LoraClient(
            session, url_for=lambda ip, path: silent.url(path), request_timeout_seconds=0.3
        )
        listing = await client.list("198.18.1.9")
        assert (listing.reason, listing.message) == ("WorkerUnreachable", "timeout")
        result = await client.unload("198.18.1.9", "sql", timeout_seconds=0.2)
        assert (result.reason, result.message) == ("RequestTimeout", "no answer within 0.2s")
