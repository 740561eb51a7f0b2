"""Drop-in for upstream: upstream Dynamo's own frontend (ai-dynamo 1.6.1, its Rust HTTP
server, tokenizer and router) discovers our `dynamo-worker` through file discovery and routes
to it over upstream's TCP request plane, on loopback.

Upstream runs from the venv `hack/oracle-venv` makes; without it these tests skip.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from support.interop_engines import FAIL_AFTER_FIRST_TOKEN_SEED, FAIL_BEFORE_OUTPUT_SEED
from support.tiny_model import TinyModel
from support.upstream import (
    SAMPLE_ENGINE,
    UpstreamFleet,
    post_json,
    post_sse,
    streams_in_flight,
    upstream_fleet,
)
from support.worker_process import WorkerProcess

pytestmark = pytest.mark.e2e
__all__ = ["upstream_fleet"]

SCRIPTED_ENGINE = "support.interop_engines:ScriptedEngine"
SERVED = "tiny-llama"


async def engine_tokens(
    worker: WorkerProcess, token_ids: list[int], max_tokens: int, model: str | None = None
) -> list[int]:
    """What our engine answers for `token_ids`, asked through the worker's own HTTP route."""
    body: dict[str, Any] = {"token_ids": token_ids, "stop_conditions": {"max_tokens": max_tokens}}
    if model is not None:
        body["model"] = model
    tokens: list[int] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(worker.http_url() + "/v1/generate", json=body) as response,
    ):
        assert response.status == 200
        async for line in response.content:
            if line.strip():
                tokens += json.loads(line)["token_ids"]
    return tokens


async def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on a worker's /metrics (0 when absent)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def chat_prompt_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt the frontend builds for `messages` (same tokenizer and chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    encoded: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    # transformers 5 answers a BatchEncoding (a mapping), older versions a list.
    return [
        int(token) for token in (encoded if isinstance(encoded, list) else encoded["input_ids"])
    ]


def sample_worker(fleet: UpstreamFleet, tiny_model: TinyModel, *args: str, **env: str) -> Any:
    return fleet.start_worker(
        "--engine",
        SAMPLE_ENGINE,
        "--model",
        str(tiny_model.base),
        "--served-model-name",
        SERVED,
        *args,
        env=env,
    )


async def test_listed_and_serving_chat_and_completions(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    worker = sample_worker(fleet, tiny_model)
    listing = await fleet.wait_models(SERVED)
    [entry] = [model for model in listing if model["id"] == SERVED]
    assert entry["context_window"] == 4096  # the card's runtime_config.context_length
    decode = Tokenizer.from_file(str(tiny_model.base / "tokenizer.json")).decode

    # Completions from token ids: the frontend passes them through, our engine answers.
    prompt = [40, 41, 42, 43]
    expected = decode(await engine_tokens(worker, prompt, 6))
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 6}
    status, answer = await post_json(frontend + "/v1/completions", body)
    assert status == 200, (answer, fleet.logs())
    assert answer["choices"][0]["text"] == expected
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    status, events = await post_sse(frontend + "/v1/completions", {**body, "stream": True})
    assert status == 200
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected

    # Chat: the frontend applies the model's chat template and tokenizes.
    messages = [{"role": "user", "content": "Tell me about the weather"}]
    prompt_ids = chat_prompt_ids(tiny_model.base, messages)
    expected = decode(await engine_tokens(worker, prompt_ids, 5))
    chat = {"model": SERVED, "messages": messages, "max_tokens": 5}
    status, answer = await post_json(frontend + "/v1/chat/completions", chat)
    assert status == 200, (answer, fleet.logs())
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    status, events = await post_sse(frontend + "/v1/chat/completions", {**chat, "stream": True})
    assert status == 200
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]]
    assert "".join(deltas) == expected
    # The four frontend requests came to our worker (plus our own two /v1/generate calls).
    assert await metric(worker.system_url(), "dynamo_component_requests_total") == 6


async def test_text_round_trips_and_engine_errors_map_to_http(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    fleet.start_worker(
        "--engine", SCRIPTED_ENGINE, "--model", str(tiny_model.base), "--served-model-name", SERVED
    )
    await fleet.wait_models(SERVED)
    text = "Workers serve requests, stream tokens, and drain gracefully."
    body = {"model": SERVED, "prompt": text, "max_tokens": 100}
    status, answer = await post_json(frontend + "/v1/completions", body)
    assert status == 200, (answer, fleet.logs())
    # The engine echoed the prompt's tokens; the frontend decoded them back to the text.
    assert answer["choices"][0]["text"] == text
    # An engine exception before any output: upstream's "Unknown" error, HTTP 500.
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    status, answer = await post_json(
        frontend + "/v1/chat/completions", {**chat, "seed": FAIL_BEFORE_OUTPUT_SEED}
    )
    assert status == 500, answer
    # (The frontend does not show the engine's message to clients.)
    assert answer["code"] == 500
    # After the first token of a stream: the stream carries an error event.
    status, events = await post_sse(
        frontend + "/v1/chat/completions",
        {**chat, "seed": FAIL_AFTER_FIRST_TOKEN_SEED, "stream": True},
    )
    assert status == 200
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert [error["code"] for error in errors] == [500], events
    # The worker still serves afterwards (an in-band error does not mark it down).
    status, answer = await post_json(frontend + "/v1/completions", body)
    assert status == 200


async def test_client_disconnect_stops_generation_in_our_engine(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    worker = sample_worker(fleet, tiny_model, "--token-delay", "0.05")
    await fleet.wait_models(SERVED)
    system = worker.system_url()
    # 2000 tokens at 50 ms each would take 100 s.
    body = {"model": SERVED, "prompt": [40, 41], "max_tokens": 2000, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(frontend + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        received = 0
        async for line in response.content:
            if line.startswith(b"data:"):
                received += 1
            if received == 3:
                break
    # Leaving the block closed the connection mid-stream.
    assert await metric(system, "dynamo_component_requests_total") == 1
    deadline = time.monotonic() + 10
    while await metric(system, "dynamo_component_inflight_requests") != 0:
        assert time.monotonic() < deadline, worker.log()
        await asyncio.sleep(0.05)
    assert await metric(system, "dynamo_component_cancellation_total") == 1


async def test_lora_adapter_loaded_on_our_worker_is_routable(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel, tmp_path: Path
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    worker = sample_worker(
        fleet, tiny_model, DYN_LORA_ENABLED="true", DYN_LORA_PATH=str(tmp_path / "loras")
    )
    await fleet.wait_models(SERVED)
    load = {
        "lora_name": "sql-lora",
        "source": {"uri": tiny_model.adapters["sql-lora"].as_uri()},
    }
    status, answer = await post_json(worker.system_url() + "/v1/loras", load)
    assert status == 200, answer
    await fleet.wait_models(SERVED, "sql-lora")
    decode = Tokenizer.from_file(str(tiny_model.base / "tokenizer.json")).decode
    prompt = [50, 51, 52]
    expected = await engine_tokens(worker, prompt, 8, model="sql-lora")
    assert expected != await engine_tokens(worker, prompt, 8)  # the adapter changes the output
    status, answer = await post_json(
        frontend + "/v1/completions", {"model": "sql-lora", "prompt": prompt, "max_tokens": 8}
    )
    assert status == 200, (answer, fleet.logs())
    assert answer["model"] == "sql-lora"
    assert answer["choices"][0]["text"] == decode(expected)


async def test_mixed_fleet_serves_on_upstream_and_our_worker(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    model = str(tiny_model.base)
    _, upstream_system = fleet.start_upstream_worker(tiny_model.base, "--component", "backend")
    await fleet.wait_models(model)
    # One model, one worker set: the frontend keeps the first card it accepted and rejects
    # workers whose card differs in what it checksums, so ours matches upstream's sample
    # engine's context length and capacity.
    ours = fleet.start_worker(
        "--engine",
        SAMPLE_ENGINE,
        "--model",
        model,
        "--context-length",
        "2048",
        "--total-kv-blocks",
        "1000",
        "--max-num-seqs",
        "64",
        "--max-loras",
        "0",
    )
    await ours.wait_health(200)
    counts = {"upstream": 0.0, "ours": 0.0}
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    deadline = time.monotonic() + 30
    while min(counts.values()) < 2:
        assert time.monotonic() < deadline, (counts, fleet.logs())
        status, answer = await post_json(frontend + "/v1/completions", body)
        assert status == 200, (answer, fleet.logs())
        assert answer["usage"]["completion_tokens"] == 4
        counts["upstream"] = await metric(upstream_system, "dynamo_component_requests_total")
        counts["ours"] = await metric(ours.system_url(), "dynamo_component_requests_total")


async def test_drain_through_the_frontend(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    # 120 tokens at 50 ms: each stream runs about 6 s.
    worker = sample_worker(fleet, tiny_model, "--token-delay", "0.05")
    await fleet.wait_models(SERVED)
    endpoint_files = list((fleet.kv / "v1" / "instances").iterdir())
    assert len(endpoint_files) == 1
    body = {
        "model": SERVED,
        "prompt": [40, 41, 42],
        "max_tokens": 120,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streams = await streams_in_flight(frontend + "/v1/completions", body, 5)
    worker.terminate()
    # Unregistered first: the Endpoint record goes at once, while the streams still run.
    deadline = time.monotonic() + 2
    while endpoint_files[0].exists():
        assert time.monotonic() < deadline, worker.log()
        await asyncio.sleep(0.02)
    assert not any(stream.done() for stream in streams)
    results = await asyncio.gather(*streams)
    for status, events in results:
        assert status == 200
        assert events[-1] == "[DONE]"
        usage = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert usage[-1]["completion_tokens"] == 120, events[-3:]
        finishes = [c.get("finish_reason") for e in events[:-1] for c in e["choices"]]
        assert [reason for reason in finishes if reason] == ["length"]
    assert await worker.wait_exit() == 0


async def test_kv_aware_routing_follows_our_kv_events(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend("--router-mode", "kv")
    workers = [sample_worker(fleet, tiny_model) for _ in range(2)]
    await fleet.wait_models(SERVED)
    # Both workers' kv-events channels are advertised, and the frontend subscribed to each.
    await fleet.wait_kv_subscriptions(2)
    # Each worker caches different prompts, served through its own HTTP route: the router
    # learns about them only from the workers' kv-events (4 blocks of 16 tokens each).
    prompts = {
        index: [[100 + 50 * index + 7 * n + j % 40 for j in range(64)] for n in range(3)]
        for index in range(2)
    }
    for index, worker in enumerate(workers):
        for prompt in prompts[index]:
            await engine_tokens(worker, prompt, 1)
    routed = []
    for index, worker_prompts in prompts.items():
        for prompt in worker_prompts:
            before = [
                await metric(w.system_url(), "dynamo_component_requests_total") for w in workers
            ]
            body = {"model": SERVED, "prompt": prompt, "max_tokens": 2}
            status, answer = await post_json(frontend + "/v1/completions", body)
            assert status == 200, answer
            after = [
                await metric(w.system_url(), "dynamo_component_requests_total") for w in workers
            ]
            served = [n for n in range(2) if after[n] > before[n]]
            routed.append((index, served))
    # Random placement would get all six right one time in 64.
    assert routed == [(index, [index]) for index in (0, 0, 0, 1, 1, 1)], (routed, fleet.logs())
