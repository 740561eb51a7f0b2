"""Pushing spec.modelTaints to ready pods: who gets a POST, retries with backoff, timeouts,
bounded concurrency, and waiting for the pod to publish what it applied.

The pods' system servers are one loopback aiohttp server whose route callback is the worker's
own (`dynamo.common.model_taints.make_model_taint_handler`), wrapped as the worker's system
server wraps engine routes (a raised error becomes HTTP 500 with a JSON body).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from dynamo.common.model_taints import make_model_taint_handler
from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.pods.taints import CONFIRM_WAIT_SECONDS, TaintPusher
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from support.loopback_http import LoopbackHttpServer, serve

pytestmark = pytest.mark.unit


@dataclass
class Worker:
    """The fake pods' shared route: what each pod applied, and injected trouble."""

    applied: dict[str, list[str]] = field(default_factory=dict)
    fail_next: int = 0
    delay_seconds: float = 0.0
    active: int = 0
    most_active: int = 0
    posts: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        async def route(request: web.Request) -> web.Response:
            pod = request.query["pod"]
            self.posts.append(pod)
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            try:
                await asyncio.sleep(self.delay_seconds)
                if self.fail_next > 0:
                    self.fail_next -= 1
                    return web.json_response(
                        {"error": "Handler error", "message": "engine busy"}, status=500
                    )

                async def record(_: Any, taints: set[str]) -> None:
                    self.applied[pod] = sorted(taints)

                handler = make_model_taint_handler(None, record)
                try:
                    return web.json_response(await handler(await request.json()))
                except ValueError as exc:
                    return web.json_response(
                        {"error": "Handler error", "message": str(exc)}, status=500
                    )
            finally:
                self.active -= 1

        app = web.Application()
        app.add_routes([web.post("/engine/update/model_taints", route)])
        return app


@pytest_asyncio.fixture
async def worker() -> AsyncIterator[tuple[Worker, LoopbackHttpServer]]:
    state = Worker()
    async with serve(state.app()) as server:
        yield state, server


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, ready: bool = True, ip: str | None = "198.18.16.2") -> PodSummary:
    return PodSummary(name=name, uid=f"uid-{name}", ip=ip, ready=ready, terminating=False)


def published(name: str, taints: list[str]) -> DynamoWorkerMetadata:
    card = {
        "type": "Model",
        "namespace": "ns-llm",
        "component": "worker",
        "endpoint": "generate",
        "instance_id": 1,
        "card_json": {"display_name": "m", "runtime_config": {"taints": taints}},
    }
    return DynamoWorkerMetadata.model_validate(
        {"metadata": {"name": name}, "spec": {"data": {"model_cards": {"k": card}}}}
    )


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def pusher(
    session: aiohttp.ClientSession, server: LoopbackHttpServer, **kwargs: Any
) -> tuple[TaintPusher, list[tuple[str, str]]]:
    done: list[tuple[str, str]] = []
    return (
        TaintPusher(
            session,
            on_done=lambda ns, w: done.append((ns, w)),
            url_for=lambda p: server.url(f"/engine/update/model_taints?pod={p.name}"),
            **kwargs,
        ),
        done,
    )


async def test_only_ready_pods_that_lag_get_a_push(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    state, server = worker
    taints, done = pusher(session, server)
    pods = [
        pod("lagging"),
        pod("current"),
        pod("starting", ready=False),
        pod("no-ip", ip=None),
        pod("no-record"),
    ]
    records = {
        "lagging": published("lagging", ["old", "dynamo.topology/zone=a"]),
        "current": published("current", ["gpu=h100", "dynamo.topology/zone=a"]),
    }
    failures = taints.sync("ns", "llm", ["gpu=h100"], pods, records)
    await taints.wait_idle()
    assert failures == {}
    assert sorted(state.posts) == ["lagging", "no-record"]
    assert state.applied == {"lagging": ["gpu=h100"], "no-record": ["gpu=h100"]}
    assert done == [("ns", "llm"), ("ns", "llm")]


async def test_nothing_is_pushed_when_no_taints_are_wanted_or_known(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    state, server = worker
    taints, _ = pusher(session, server)
    taints.sync("ns", "llm", [], [pod("a")], {})
    await taints.wait_idle()
    assert state.posts == []
    # Clearing taints a pod published is a push of the empty list.
    taints.sync("ns", "llm", [], [pod("a")], {"a": published("a", ["gpu=h100"])})
    await taints.wait_idle()
    assert state.applied == {"a": []}


async def test_waits_for_the_pod_to_publish_before_pushing_again(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    state, server = worker
    clock = Clock()
    taints, _ = pusher(session, server, clock=clock)
    stale = {"a": published("a", [])}
    taints.sync("ns", "llm", ["t1"], [pod("a")], stale)
    taints.sync("ns", "llm", ["t1"], [pod("a")], stale)  # in flight: no second POST
    await taints.wait_idle()
    taints.sync("ns", "llm", ["t1"], [pod("a")], stale)  # applied, not yet published
    await taints.wait_idle()
    assert state.posts == ["a"]
    clock.now += CONFIRM_WAIT_SECONDS + 1  # the record never showed it: push again
    taints.sync("ns", "llm", ["t1"], [pod("a")], stale)
    await taints.wait_idle()
    assert state.posts == ["a", "a"]
    # A changed spec is pushed at once.
    taints.sync("ns", "llm", ["t2"], [pod("a")], stale)
    await taints.wait_idle()
    assert state.applied["a"] == ["t2"]
    assert len(state.posts) == 3


async def test_transient_errors_are_retried_within_a_push(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    state, server = worker
    state.fail_next = 2
    taints, _ = pusher(session, server, attempts=3, backoff_seconds=0.01)
    assert taints.sync("ns", "llm", ["t"], [pod("a")], {}) == {}
    await taints.wait_idle()
    assert state.posts == ["a", "a", "a"]
    assert state.applied == {"a": ["t"]}


async def test_persistent_failure_is_reported_and_retried_with_backoff(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    state, server = worker
    state.fail_next = 100
    clock = Clock()
    taints, _ = pusher(session, server, attempts=2, backoff_seconds=0.01, clock=clock)
    taints.sync("ns", "llm", ["t"], [pod("a")], {})
    await taints.wait_idle()
    assert len(state.posts) == 2
    failures = taints.sync("ns", "llm", ["t"], [pod("a")], {})
    assert failures == {"a": 'HTTP 500: {"error": "Handler error", "message": "engine busy"}'}
    await taints.wait_idle()
    assert len(state.posts) == 2  # backing off
    clock.now += 60
    state.fail_next = 0
    taints.sync("ns", "llm", ["t"], [pod("a")], {})
    await taints.wait_idle()
    assert state.applied == {"a": ["t"]}
    assert taints.sync("ns", "llm", ["t"], [pod("a")], {"a": published("a", ["t"])}) == {}


async def test_a_refused_body_is_a_failure_with_the_workers_message(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    _, server = worker
    taints, _ = pusher(session, server, attempts=1)
    taints.sync("ns", "llm", ["dynamo.topology/zone=b"], [pod("a")], {})
    await taints.wait_idle()
    failures = taints.sync("ns", "llm", ["dynamo.topology/zone=b"], [pod("a")], {})
    assert "uses reserved prefix 'dynamo.topology/'" in failures["a"]


async def test_slow_pods_time_out(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    state, server = worker
    state.delay_seconds = 2.0
    taints, _ = pusher(session, server, attempts=1, timeout_seconds=0.2)
    taints.sync("ns", "llm", ["t"], [pod("a")], {})
    await taints.wait_idle()
    assert taints.sync("ns", "llm", ["t"], [pod("a")], {}) == {"a": "TimeoutError"}


async def test_concurrency_is_bounded(
    worker: tuple[Worker, LoopbackHttpServer], session: aiohttp.ClientSession
) -> None:
    state, server = worker
    state.delay_seconds = 0.05
    taints, _ = pusher(session, server, concurrency=3)
    taints.sync("ns", "llm", ["t"], [pod(f"p{i}") for i in range(12)], {})
    await taints.wait_idle()
    assert len(state.applied) == 12
    assert state.most_active == 3
