"""The hold: bounded, timed, waiting for a pod that serves the request's model (LoRA too),
and the HTTP answer when it gives up (503, Retry-After, OpenAI's error shape)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from dynamo.activator.hold import Hold, HoldClosed, HoldExpired, HoldFull
from dynamo.activator.http_proxy import HttpProxy
from dynamo.activator.metrics import ActivatorMetrics
from dynamo.activator.pods import Fleet, ReadyPod

pytestmark = pytest.mark.unit

WORKER = "team-a/llama"


def pod(name: str, *models: str) -> ReadyPod:
    return ReadyPod(name, f"http://127.0.0.1:1/{name}", None, frozenset(models), {})


def make_hold(max_held: int = 4, timeout_s: float = 30.0) -> Hold:
    return Hold(Fleet(), ActivatorMetrics(), worker=WORKER, max_held=max_held, timeout_s=timeout_s)


def sample(hold: Hold, name: str) -> float:
    value = hold.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


async def until_held(hold: Hold, count: int) -> None:
    # The count changes inside `wait`'s first step: yielding one loop turn at a time, no
    # sleeping, until it does.
    while hold.held != count:  # noqa: ASYNC110
        await asyncio.sleep(0)


async def test_a_ready_pod_is_handed_out_at_once_without_holding() -> None:
    hold = make_hold()
    hold.fleet.update([pod("p0", "llama")])
    ticket = hold.ticket("llama")
    assert (await hold.wait(ticket)).name == "p0"
    assert sample(hold, "dynamo_activator_held_requests") == 0


async def test_a_held_request_waits_for_the_first_ready_pod() -> None:
    hold = make_hold()
    ticket = hold.ticket("llama")
    waiting = asyncio.create_task(hold.wait(ticket))
    await until_held(hold, 1)
    assert sample(hold, "dynamo_activator_held_requests") == 1
    hold.fleet.update([pod("p0", "llama")])
    assert (await waiting).name == "p0"
    hold.forwarded(ticket)
    assert sample(hold, "dynamo_activator_held_requests") == 0
    assert sample(hold, "dynamo_activator_forwarded_total") == 1
    assert sample(hold, "dynamo_activator_wait_seconds_count") == 1


async def test_over_the_bound_a_request_is_refused_at_once() -> None:
    hold = make_hold(max_held=2)
    held = [asyncio.create_task(hold.wait(hold.ticket(None))) for _ in range(2)]
    await until_held(hold, 2)
    with pytest.raises(HoldFull, match="holds 2 requests"):
        await hold.wait(hold.ticket(None))
    assert sample(hold, "dynamo_activator_refused_total") == 1
    hold.fleet.update([pod("p0", "llama")])
    assert [p.name for p in await asyncio.gather(*held)] == ["p0", "p0"]


async def test_a_request_expires_naming_the_worker_and_what_it_waited_for() -> None:
    hold = make_hold(timeout_s=0.05)
    with pytest.raises(HoldExpired) as expired:
        await hold.wait(hold.ticket(None))
    assert WORKER in str(expired.value)
    assert "a ready pod" in str(expired.value)
    assert sample(hold, "dynamo_activator_expired_total") == 1
    assert hold.held == 0


async def test_a_lora_request_waits_until_a_ready_pod_lists_the_adapter() -> None:
    hold = make_hold()
    waiting = asyncio.create_task(hold.wait(hold.ticket("sql-lora")))
    await until_held(hold, 1)
    hold.fleet.update([pod("p0", "llama")])  # ready, but the adapter is not loaded yet
    await asyncio.sleep(0.01)
    assert not waiting.done()
    hold.fleet.update([pod("p0", "llama", "sql-lora")])
    assert (await waiting).name == "p0"


async def test_a_pod_that_turned_the_request_away_is_skipped_until_the_pods_change() -> None:
    hold = make_hold()
    hold.fleet.update([pod("p0", "llama"), pod("p1", "llama")])
    ticket = hold.ticket("llama")
    assert (await hold.wait(ticket, frozenset({"p0"}))).name == "p1"
    waiting = asyncio.create_task(hold.wait(ticket, frozenset({"p0", "p1"})))
    await until_held(hold, 1)
    hold.fleet.update([pod("p0", "llama")])
    assert (await waiting).name == "p0"


async def test_closing_answers_every_held_request() -> None:
    hold = make_hold()
    waiting = asyncio.create_task(hold.wait(hold.ticket(None)))
    await until_held(hold, 1)
    hold.close()
    with pytest.raises(HoldClosed):
        await waiting
    with pytest.raises(HoldClosed):
        await hold.wait(hold.ticket(None))


@pytest.fixture
async def proxy_url() -> AsyncIterator[tuple[str, Hold]]:
    hold = make_hold(max_held=1, timeout_s=0.2)
    async with aiohttp.ClientSession() as session:
        runner = web.AppRunner(HttpProxy(hold, lambda: None, session).app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", hold
        await runner.cleanup()


async def test_http_timeout_is_a_503_with_retry_after_and_an_openai_error(
    proxy_url: tuple[str, Hold],
) -> None:
    url, _hold = proxy_url
    body = {"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 503
        assert int(response.headers["Retry-After"]) > 0
        error = (await response.json())["error"]
    assert error["code"] == "activator_hold_timeout"
    assert error["type"] == "service_unavailable"
    assert WORKER in error["message"]
    assert "'sql-lora'" in error["message"]


async def test_http_over_the_bound_is_refused_at_once(proxy_url: tuple[str, Hold]) -> None:
    url, hold = proxy_url
    hold.timeout_s = 30
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(session.post(url + "/v1/completions", json={"prompt": "a"}))
        await until_held(hold, 1)
        async with session.post(url + "/v1/completions", json={"prompt": "b"}) as response:
            assert response.status == 503
            assert "Retry-After" in response.headers
            assert (await response.json())["error"]["code"] == "activator_hold_full"
        hold.close()
        async with await first as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "activator_shutting_down"


async def test_models_listing_is_empty_without_cards(proxy_url: tuple[str, Hold]) -> None:
    url, hold = proxy_url
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as response:
        assert await response.json() == {"object": "list", "data": []}
    assert hold.held == 0
