"""Upstream Dynamo's frontend (ai-dynamo 1.6.1) routes by KV cache to our vLLM workers.

Two `dynamo-worker --engine vllm` processes (the venv `hack/vllm-venv` makes) publish through
file discovery with the TCP request plane and the ZMQ event plane; upstream's frontend runs
with `--router-mode kv`. Each worker caches different prompts through its own HTTP route, so
the router learns of them only from the KV events vLLM published and our bridge re-published:
every prompt sent through the frontend must then go to the worker that holds it. Skipped
without either venv.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import vllm
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import UpstreamFleet, upstream_fleet

pytestmark = pytest.mark.e2e
__all__ = ["upstream_fleet"]

SERVED = "tiny-llama"


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
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            answer = await response.json()
        assert response.status == 200, answer


async def test_kv_aware_routing_follows_vllm_kv_events(
    upstream_fleet: UpstreamFleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    python = vllm.vllm_python_or_skip()
    fleet = upstream_fleet
    root = tmp_path_factory.mktemp("vllm-frontend")
    load_generator().write_tiny_model(root / "model", TINY_MODEL_SEED, head_dim=64)
    frontend = await fleet.start_frontend("--router-mode", "kv")
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(fleet.kv),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    }
    workers = [
        vllm.start_our_worker(
            python, root / "model" / "base", root / f"worker-{n}.log", served_name=SERVED, env=env
        )
        for n in range(2)
    ]
    fleet.processes.extend(worker.process for worker in workers)
    for worker in workers:
        await vllm.wait_ready(worker)
    await fleet.wait_models(SERVED, within=120)
    # Both workers' kv-events channels are advertised, and the frontend subscribed to each.
    await fleet.wait_kv_subscriptions(2)
    cards = [json.loads(p.read_text()) for p in (fleet.kv / "v1" / "mdc").iterdir()]
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
            await complete(frontend, prompt)
            after = [await requests_served(w.system_url) for w in workers]
            routed.append((index, [n for n in range(2) if after[n] > before[n]]))
    # Random placement would get all four right one time in 16.
    assert routed == [(index, [index]) for index in (0, 0, 1, 1)], (routed, fleet.logs())
