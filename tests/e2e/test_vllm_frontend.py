"""Upstream Dynamo's frontend (ai-dynamo 1.6.1) in front of our vLLM workers and upstream's own.

One fleet for the module: upstream's frontend with `--router-mode kv`, file discovery, the TCP
request plane and the ZMQ event plane; behind it two `dynamo-worker --engine vllm` processes
(the venv `hack/vllm-venv` makes) serving the tiny model as `tiny-ours`, and upstream's own
vLLM worker (`python -m dynamo.vllm`, `hack/upstream-vllm-venv`) serving it as
`tiny-upstream`, with the same engine arguments, each served name in a Dynamo namespace of its
own. All three engines start at once. Skipped without any of the three venvs.

- KV-aware routing: each of our workers caches different prompts through its own HTTP route,
  so the router learns of them only from the KV events vLLM published and our bridge
  re-published: every prompt sent through the frontend must then go to the worker that holds
  it.
- A differential test over the TCP request plane: bad requests (a prompt past the context,
  `top_p: 2`, a token id past the vocabulary) show the client the same status and error type
  through the frontend from our workers as from upstream's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import vllm
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import UpstreamFleet, oracle_venv, upstream_python

pytestmark = pytest.mark.e2e

OURS = "tiny-ours"
THEIRS = "tiny-upstream"
HI = [{"role": "user", "content": "hi"}]
LONG = "hello world " * 3000
LONG_CHAT = {"messages": [{"role": "user", "content": LONG}]}

BAD_REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("prompt past the context", "/v1/completions", {"prompt": LONG, "max_tokens": 4}),
    ("messages past the context", "/v1/chat/completions", LONG_CHAT),
    ("top_p 2", "/v1/chat/completions", {"messages": HI, "top_p": 2, "max_tokens": 4}),
    ("token id past the vocabulary", "/v1/completions", {"prompt": [99999999], "max_tokens": 4}),
]


class Fleet:
    """The module's fleet and what runs behind its frontend."""

    def __init__(self, fleet: UpstreamFleet, behind: vllm.BehindFrontend) -> None:
        self.fleet = fleet
        self.behind = behind


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    upstream_python()
    root = tmp_path_factory.mktemp("vllm-frontend")
    load_generator().write_tiny_model(root / "model", TINY_MODEL_SEED, head_dim=64)
    fleet = UpstreamFleet(oracle_venv(), root)
    try:
        behind = await vllm.start_behind_frontend(
            fleet,
            root / "model" / "base",
            root,
            "--router-mode",
            "kv",
            ours=OURS,
            theirs=THEIRS,
            our_workers=2,
        )
        yield Fleet(fleet, behind)
    finally:
        fleet.close()


async def requests_served(system_url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(system_url + "/metrics") as r:
        text = await r.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dynamo_component_requests_total"
    )


async def complete(url: str, prompt: list[int]) -> None:
    body = {"model": OURS, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            answer = await response.json()
        assert response.status == 200, answer


async def test_kv_aware_routing_follows_vllm_kv_events(fleet: Fleet) -> None:
    workers = fleet.behind.ours
    # Both workers' kv-events channels are advertised, and the frontend subscribed to each.
    await fleet.fleet.wait_kv_subscriptions(2, namespace=f"{OURS}-ns")
    cards = [json.loads(p.read_text()) for p in (fleet.fleet.kv / "v1" / "mdc").iterdir()]
    block = next(c.get("card_json", c)["kv_cache_block_size"] for c in cards)
    # Two full blocks per prompt, different per worker and per prompt.
    prompts = {
        index: [
            [(100 + 50 * index + 7 * n + j) % 400 + 10 for j in range(2 * block)] for n in range(2)
        ]
        for index in range(2)
    }
    for index, worker in enumerate(workers):
        for prompt in prompts[index]:
            await complete(worker.url, prompt)
    routed = []
    for index, worker_prompts in prompts.items():
        for prompt in worker_prompts:
            before = [await requests_served(w.system_url) for w in workers]
            await complete(fleet.behind.url, prompt)
            after = [await requests_served(w.system_url) for w in workers]
            routed.append((index, [n for n in range(2) if after[n] > before[n]]))
    # Random placement would get all four right one time in 16.
    assert routed == [(index, [index]) for index in (0, 0, 1, 1)], (routed, fleet.fleet.logs())


async def error_of(frontend: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The status and the error's `type` (None when the body has none) the client sees."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession() as session,
        session.post(frontend + path, json=body, timeout=timeout) as response,
    ):
        text = await response.text()
    try:
        answer: Any = json.loads(text)
    except ValueError:
        answer = text
    error = answer.get("error", answer) if isinstance(answer, dict) else answer
    kind = error.get("type") if isinstance(error, dict) else None
    return response.status, kind


async def test_bad_requests_through_upstreams_frontend_match_upstreams_vllm_worker(
    fleet: Fleet,
) -> None:
    table: list[str] = []
    mismatches: list[str] = []
    for name, path, body in BAD_REQUESTS:
        ours = await error_of(fleet.behind.url, path, {**body, "model": OURS})
        theirs = await error_of(fleet.behind.url, path, {**body, "model": THEIRS})
        table.append(f"{name}: ours {ours}, upstream's worker {theirs}")
        if ours != theirs:
            mismatches.append(table[-1])
    print("\n".join(table))
    assert not mismatches, "\n".join([*mismatches, "", fleet.fleet.logs()[-6000:]])
