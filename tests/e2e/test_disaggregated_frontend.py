"""Disaggregated serving through upstream's own frontend (ai-dynamo 1.6.1), on loopback:
our prefill worker and our decode worker (the sample engine, whose hand-over names the prompt
and adapter it prefilled) register as upstream's roles do; the frontend pairs them, sends each
request to prefill first and then to decode with the prefill result.

The decode worker refuses a request whose prefill result is missing or made for another
prompt or adapter, so a request that skipped prefill, or a LoRA adapter that reached one role
only, fails these tests. Upstream runs from the venv `hack/oracle-venv` makes; without it they
skip. The vLLM version, with the KV cache moved by NIXL, runs on the test bed
(tests/e2e/test_vllm_disaggregated.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer

from support.testbed_workers import metric_sum
from support.tiny_model import TinyModel
from support.upstream import SAMPLE_ENGINE, UpstreamFleet, post_json, post_sse, upstream_fleet
from support.worker_process import WorkerProcess

pytestmark = pytest.mark.e2e
__all__ = ["upstream_fleet"]

SERVED = "tiny-llama"
PROMPT = [40, 41, 42, 43, 44]
REQUESTS = "dynamo_component_requests_total"


def role_worker(
    fleet: UpstreamFleet, tiny_model: TinyModel, mode: str, *args: str, **env: str
) -> WorkerProcess:
    return fleet.start_worker(
        "--engine",
        SAMPLE_ENGINE,
        "--model",
        str(tiny_model.base),
        "--served-model-name",
        SERVED,
        "--disaggregation-mode",
        mode,
        *args,
        env={"DYN_HEALTH_CHECK_ENABLED": "false", **env},
    )


async def engine_tokens(worker: WorkerProcess, model: str | None = None) -> list[int]:
    """What an aggregated worker answers for PROMPT (8 tokens), asked on its own HTTP route."""
    body: dict[str, Any] = {"token_ids": PROMPT, "stop_conditions": {"max_tokens": 8}}
    if model is not None:
        body["model"] = model
    tokens: list[int] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(worker.http_url() + "/v1/generate", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.strip():
                tokens += json.loads(line)["token_ids"]
    return tokens


async def requests_served(worker: WorkerProcess) -> float:
    return await metric_sum(worker.system_url(), REQUESTS)


async def load_adapter(worker: WorkerProcess, tiny_model: TinyModel) -> None:
    load = {"lora_name": "sql-lora", "source": {"uri": tiny_model.adapters["sql-lora"].as_uri()}}
    status, answer = await post_json(worker.system_url() + "/v1/loras", load)
    assert status == 200, answer


async def test_the_frontend_prefills_then_decodes_with_the_adapter_on_both_roles(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel, tmp_path: Path
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    lora = {"DYN_LORA_ENABLED": "true"}
    prefill = role_worker(fleet, tiny_model, "prefill", DYN_LORA_PATH=str(tmp_path / "p"), **lora)
    decode = role_worker(fleet, tiny_model, "decode", DYN_LORA_PATH=str(tmp_path / "d"), **lora)
    # The reference: an aggregated worker nobody discovers (in-memory discovery).
    reference = role_worker(
        fleet,
        tiny_model,
        "agg",
        DYN_DISCOVERY_BACKEND="mem",
        DYN_LORA_PATH=str(tmp_path / "r"),
        **lora,
    )
    await fleet.wait_models(SERVED)
    await fleet.wait_prefill_router()
    text = Tokenizer.from_file(str(tiny_model.base / "tokenizer.json")).decode
    expected = await engine_tokens(reference)
    before = {role: await requests_served(w) for role, w in (("p", prefill), ("d", decode))}

    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 8}
    status, answer = await post_json(frontend + "/v1/completions", body)
    assert status == 200, (answer, fleet.logs())
    assert answer["choices"][0]["text"] == text(expected)
    assert answer["usage"]["completion_tokens"] == 8
    status, events = await post_sse(frontend + "/v1/completions", {**body, "stream": True})
    assert status == 200
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text(expected)
    # Each request went through both roles: prefill first (the decode worker refuses a request
    # without its prefill result).
    assert await requests_served(prefill) == before["p"] + 2
    assert await requests_served(decode) == before["d"] + 2

    # LoRA: the adapter on both roles; the decode worker checks that the prefill was made with
    # it (its hand-over names the adapter).
    for worker in (prefill, decode, reference):
        await load_adapter(worker, tiny_model)
    await fleet.wait_models(SERVED, "sql-lora")
    with_adapter = await engine_tokens(reference, "sql-lora")
    assert with_adapter != expected
    status, answer = await post_json(frontend + "/v1/completions", {**body, "model": "sql-lora"})
    assert status == 200, (answer, fleet.logs())
    assert answer["choices"][0]["text"] == text(with_adapter)


async def test_decode_drains_its_streams_on_sigterm(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    role_worker(fleet, tiny_model, "prefill")
    # 100 tokens at 100 ms: each stream runs about 10 s, time enough for all four to start on
    # a busy machine.
    decode = role_worker(fleet, tiny_model, "decode", "--token-delay", "0.1")
    await fleet.wait_models(SERVED)
    await fleet.wait_prefill_router()
    body = {
        "model": SERVED,
        "prompt": PROMPT,
        "max_tokens": 100,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streams = [asyncio.create_task(post_sse(frontend + "/v1/completions", body)) for _ in range(4)]
    # Once every stream is decoding, stop the decode worker.
    while await metric_sum(decode.system_url(), "dynamo_component_inflight_requests") != 4:
        ended = [stream.result() for stream in streams if stream.done()]
        assert not ended, (ended, fleet.logs())
        await asyncio.sleep(0.05)
    decode.terminate()
    results = await asyncio.gather(*streams)
    for status, events in results:
        assert status == 200
        assert events[-1] == "[DONE]"
        usage = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert usage[-1]["completion_tokens"] == 100, events[-3:]
    assert await decode.wait_exit() == 0
