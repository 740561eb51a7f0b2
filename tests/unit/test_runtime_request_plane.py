"""The request plane on loopback, serving the sample engine in-process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.common.backend import EngineConfig, GenerateRequest, LLMEngine, WorkerConfig
from dynamo.common.lora import LoRAManager
from dynamo.common.token_budget import TokenBudget
from dynamo.engines.sample import SampleEngine, SampleEngineArgs
from dynamo.runtime import generation
from dynamo.runtime.context import Context
from dynamo.runtime.http_plane.server import RequestPlane
from dynamo.runtime.inflight import InflightTracker
from dynamo.runtime.metrics import RuntimeMetrics, auto_labels
from dynamo.runtime.models import ServedModels
from dynamo.runtime.serving import Serving
from support.lora_adapters import adapter_files, lora_env, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


class Plane:
    """A started request plane and what it serves."""

    def __init__(self, engine: Any, plane: RequestPlane, tracker: InflightTracker, url: str):
        self.engine = engine
        self.plane = plane
        self.tracker = tracker
        self.url = url
        self.metrics: RuntimeMetrics = plane.serving.metrics  # the registry under test

    def metric(self, name: str) -> float:
        text = self.metrics.exposition()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise AssertionError(name)

    def by_model(self, name: str, **labels: str) -> float:
        """The `dynamo_worker_*` sample `name` of model "sample-model" with `labels`."""
        wanted = {"model": "sample-model", **labels}
        return sum(
            sample.value
            for family in text_string_to_metric_families(self.metrics.exposition())
            for sample in family.samples
            if sample.name == name and wanted.items() <= sample.labels.items()
        )


async def start_plane(engine: Any, *, budget: TokenBudget | None = None) -> Plane:
    metrics = RuntimeMetrics(auto_labels("ns", "backend", "generate", 5))
    tracker = InflightTracker()
    plane = RequestPlane(
        Serving(
            engine,
            models=ServedModels(base="sample-model", created=1),
            metrics=metrics,
            tracker=tracker,
            budget=budget,
        )
    )
    port = await plane.start("127.0.0.1", 0)
    return Plane(engine, plane, tracker, f"http://127.0.0.1:{port}")


@pytest.fixture
async def served() -> AsyncIterator[Plane]:
    engine = SampleEngine(SampleEngineArgs(max_tokens=8), lora_manager=LoRAManager())
    await engine.start(5)
    plane = await start_plane(engine)
    yield plane
    await plane.plane.stop()
    await engine.cleanup()


async def sse_events(response: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def expected_text(
    engine: SampleEngine, token_ids: list[int], n: int, model: str | None = None
) -> str:
    request: GenerateRequest = {"token_ids": token_ids, "stop_conditions": {"max_tokens": n}}
    if model:
        request["model"] = model
    ids = [t async for chunk in engine.generate(request, Context()) for t in chunk["token_ids"]]
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(ids)


async def test_completions_non_streaming(served: Plane) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "sample-model", "prompt": "hello", "max_tokens": 6}
        async with session.post(served.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            answer = await response.json()
    assert answer["object"] == "text_completion"
    assert answer["id"].startswith("cmpl-")
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == await expected_text(
        served.engine, served.engine.tokenizer.encode("hello"), 6
    )
    assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert served.metric("dynamo_component_requests_total") == 1
    assert served.metric("dynamo_component_inflight_requests") == 0


async def test_chat_streaming_with_usage(served: Plane) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(served.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    tokenizer = served.engine.tokenizer
    prompt = tokenizer.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True
    )
    assert text == await expected_text(
        served.engine, tokenizer.encode(prompt, add_special_tokens=False), 5
    )
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_chat_non_streaming_and_completions_streaming(served: Plane) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with session.post(served.url + "/v1/chat/completions", json=body) as response:
            answer = await response.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert len(answer["choices"][0]["message"]["content"]) == 3
        body = {"prompt": "abc", "max_tokens": 4, "stream": True}
        async with session.post(served.url + "/v1/completions", json=body) as response:
            events = await sse_events(response)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == await expected_text(
        served.engine, served.engine.tokenizer.encode("abc"), 4
    )


async def test_generate_streams_ndjson(served: Plane) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 4}}
        async with session.post(served.url + "/v1/generate", json=body) as response:
            assert response.headers["Content-Type"] == "application/x-ndjson"
            lines = [json.loads(line) async for line in response.content if line.strip()]
    assert [line.get("finish_reason") for line in lines] == [None, None, None, "length"]
    assert lines[-1]["completion_usage"]["completion_tokens"] == 4


async def test_stop_strings_cut_the_output(served: Plane) -> None:
    full = await expected_text(served.engine, served.engine.tokenizer.encode("p"), 8)
    stop = full[3:5]
    cut = full.find(stop)
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "p", "max_tokens": 8, "stop": [stop]}
        async with session.post(served.url + "/v1/completions", json=body) as response:
            answer = await response.json()
    assert answer["choices"][0]["text"] == full[:cut]
    assert answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", b"{", 400, "request body is not valid JSON"),
        ("/v1/completions", b'{"prompt": "x", "n": 3}', 400, "'n' must be 1"),
        ("/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "`gpt-9` does not exist"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "'messages' must be"),
        ("/v1/generate", b'{"token_ids": "abc"}', 400, "'token_ids' must be an array"),
        ("/v1/generate", b"[1]", 400, "must be a JSON object"),
    ],
)
async def test_bad_requests(
    served: Plane, path: str, body: bytes, status: int, message: str
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(served.url + path, data=body) as response,
    ):
        assert response.status == status
        error = (await response.json())["error"]
    assert message in error["message"]
    assert error["code"] == status


async def test_token_budget_is_enforced() -> None:
    engine = SampleEngine(SampleEngineArgs())
    await engine.start(1)
    plane = await start_plane(engine, budget=TokenBudget(10, True, True))
    try:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "x" * 20, "max_tokens": 1}
            async with session.post(plane.url + "/v1/completions", json=body) as response:
                assert response.status == 400
                message = (await response.json())["error"]["message"]
            assert "combined limit is 10 tokens" in message
            body = {"token_ids": [1] * 6, "stop_conditions": {"max_tokens": 5}}
            async with session.post(plane.url + "/v1/generate", json=body) as response:
                assert response.status == 400
                assert "limit of 10 tokens" in (await response.json())["error"]["message"]
            # Without max_tokens the request gets the rest of the budget.
            async with session.post(
                plane.url + "/v1/completions", json={"prompt": "abc"}
            ) as response:
                answer = await response.json()
            assert answer["usage"]["completion_tokens"] == 10 - 4
        assert plane.by_model("dynamo_worker_token_budget_refusals_total", adapter="") == 2
        refused = {"status": "error", "error_type": "invalid_argument"}
        assert plane.by_model("dynamo_worker_requests_total", **refused) == 2
        assert plane.by_model("dynamo_worker_requests_total", status="success") == 1
        assert plane.by_model("dynamo_worker_output_tokens_total") == 10 - 4
    finally:
        await plane.plane.stop()
        await engine.cleanup()


async def test_adapter_selected_by_model(served: Plane, lora_env: Path) -> None:
    path = write_tree(lora_env / "a", adapter_files(2))
    await served.engine.engine_update(
        "load_lora", {"lora_name": "tuned", "source": {"uri": f"file://{path}"}}
    )
    served.plane.serving.models.adapters = {"tuned": 1}
    async with aiohttp.ClientSession() as session:
        answers = {}
        for model in ("sample-model", "tuned"):
            body = {"model": model, "prompt": "same prompt", "max_tokens": 8}
            async with session.post(served.url + "/v1/completions", json=body) as response:
                answers[model] = (await response.json())["choices"][0]["text"]
        body = {"model": "not-served", "prompt": "x", "max_tokens": 1}
        async with session.post(served.url + "/v1/completions", json=body) as response:
            assert response.status == 404
        async with session.get(served.url + "/v1/models") as response:
            models = await response.json()
    # By model and adapter; an unknown name is never a label value (bounded cardinality).
    for adapter in ("", "tuned"):
        ok = {"adapter": adapter, "status": "success", "error_type": ""}
        assert served.by_model("dynamo_worker_requests_total", **ok) == 1
        assert served.by_model("dynamo_worker_output_tokens_total", adapter=adapter) == 8
        ttft = "dynamo_worker_time_to_first_token_seconds_count"
        assert served.by_model(ttft, adapter=adapter) == 1
        itl = "dynamo_worker_inter_token_latency_seconds_count"
        assert served.by_model(itl, adapter=adapter) >= 1
    missing = {"adapter": "", "status": "error", "error_type": "not_found"}
    assert served.by_model("dynamo_worker_requests_total", **missing) == 1
    assert "not-served" not in served.metrics.exposition()
    assert answers["sample-model"] != answers["tuned"]
    assert answers["tuned"] == await expected_text(
        served.engine, served.engine.tokenizer.encode("same prompt"), 8, model="tuned"
    )
    assert [entry["id"] for entry in models["data"]] == ["sample-model", "tuned"]


async def test_draining_refuses_with_retry_after(served: Plane) -> None:
    served.tracker.refuse_new()
    async with (
        aiohttp.ClientSession() as session,
        session.post(served.url + "/v1/completions", json={"prompt": "x"}) as response,
    ):
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["type"] == "service_unavailable"


async def wait_for(condition: Any, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_client_disconnect_aborts_in_the_engine() -> None:
    engine = SampleEngine(SampleEngineArgs(token_delay=0.02, max_tokens=10_000))
    await engine.start(1)
    plane = await start_plane(engine)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "x", "stream": True}
            headers = {"x-request-id": "disconnect-me"}
            async with session.post(
                plane.url + "/v1/completions", json=body, headers=headers
            ) as response:
                await response.content.readline()
        await wait_for(lambda: engine.aborted == ["disconnect-me"], "the engine abort")
        await wait_for(lambda: len(plane.tracker) == 0, "the request to end")
        assert plane.metric("dynamo_component_cancellation_total") == 1
        cancelled = {"status": "cancelled", "error_type": ""}
        assert plane.by_model("dynamo_worker_requests_total", **cancelled) == 1
    finally:
        await plane.plane.stop()
        await engine.cleanup()


async def test_drain_stop_ends_streams_cancelled() -> None:
    engine = SampleEngine(SampleEngineArgs(token_delay=0.02, max_tokens=10_000))
    await engine.start(1)
    plane = await start_plane(engine)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "x", "stream": True}
            async with session.post(plane.url + "/v1/completions", json=body) as response:
                await response.content.readline()
                assert plane.tracker.stop_all() == 1
                events = await sse_events(response)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "cancelled"
        await wait_for(lambda: len(plane.tracker) == 0, "the request to end")
        cancelled = {"status": "cancelled", "error_type": ""}
        assert plane.by_model("dynamo_worker_requests_total", **cancelled) == 1
        assert plane.by_model("dynamo_worker_requests_total", status="success") == 0
    finally:
        await plane.plane.stop()
        await engine.cleanup()


class StubbornEngine(LLMEngine):
    """Streams forever and ignores aborts; or ends without a terminal; or fails."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.tokenizer = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[StubbornEngine, WorkerConfig]:
        return cls("forever"), WorkerConfig(namespace="t")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="stubborn")

    async def cleanup(self) -> None:
        return None

    async def generate(self, request: GenerateRequest, context: Any) -> AsyncGenerator[Any, None]:
        if self.mode == "fail":
            raise RuntimeError("device lost")
        if self.mode == "short":
            yield {"token_ids": [1], "index": 0}
            return
        while True:
            yield {"token_ids": [1], "index": 0}
            await asyncio.sleep(0.01 if self.mode == "forever" else 3600)


async def test_engine_ignoring_abort_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "ABORT_GRACE_SECS", 0.05)
    plane = await start_plane(StubbornEngine("forever"))
    try:
        async with aiohttp.ClientSession() as session:
            body = {"token_ids": [1]}
            async with session.post(plane.url + "/v1/generate", json=body) as response:
                await response.content.readline()
                plane.tracker.stop_all()
                lines = [json.loads(line) async for line in response.content if line.strip()]
        assert lines[-1] == {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
    finally:
        await plane.plane.stop()


async def test_blocked_engine_is_cancelled_by_the_drain() -> None:
    plane = await start_plane(StubbornEngine("blocked"))
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(plane.url + "/v1/generate", json={"token_ids": [1]}) as response,
        ):
            await response.content.readline()
            plane.tracker.stop_all()
            assert plane.tracker.cancel_all() == 1
            lines = [json.loads(line) async for line in response.content if line.strip()]
        assert lines[-1]["finish_reason"] == "cancelled"
        assert await plane.tracker.wait_idle(5)
    finally:
        await plane.plane.stop()


async def test_stream_without_terminal_and_engine_failure() -> None:
    for mode, expected in (("short", "without a terminal chunk"), ("fail", "device lost")):
        plane = await start_plane(StubbornEngine(mode))
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(plane.url + "/v1/generate", json={"token_ids": [1]}) as response,
            ):
                lines = [json.loads(line) async for line in response.content if line.strip()]
            assert expected in lines[-1]["error"]["message"]
            async with (
                aiohttp.ClientSession() as session,
                session.post(plane.url + "/v1/completions", json={"prompt": "x"}) as response,
            ):
                assert response.status == 404  # no tokenizer: no text routes
        finally:
            await plane.plane.stop()
