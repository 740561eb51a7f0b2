"""Coalesced streaming on the request plane: chunks that come out together share one write,
a chunk after a pause is written at once, a slow client pauses the engine, and the
streamed SSE events are byte for byte the documented event shapes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.common.backend import EngineConfig, GenerateRequest, LLMEngine, WorkerConfig
from dynamo.engines.sample import SampleEngine, SampleEngineArgs
from dynamo.runtime.context import Context
from dynamo.runtime.http_plane import openai
from dynamo.runtime.http_plane.coalesce import OutputBuffer
from dynamo.runtime.http_plane.server import RequestPlane
from dynamo.runtime.inflight import InflightTracker
from dynamo.runtime.metrics import RuntimeMetrics, auto_labels
from dynamo.runtime.models import ServedModels
from dynamo.runtime.serving import Serving

pytestmark = pytest.mark.unit


async def serve(engine: Any, flush_interval: float) -> tuple[RequestPlane, str]:
    metrics = RuntimeMetrics(auto_labels("ns", "backend", "generate", 5))
    plane = RequestPlane(
        Serving(
            engine,
            models=ServedModels(base="sample-model", created=1),
            metrics=metrics,
            tracker=InflightTracker(),
        ),
        flush_interval=flush_interval,
    )
    port = await plane.start("127.0.0.1", 0)
    return plane, f"http://127.0.0.1:{port}"


def response_bytes(plane: RequestPlane) -> float:
    for family in text_string_to_metric_families(plane.serving.metrics.exposition()):
        for sample in family.samples:
            if sample.name == "dynamo_component_response_bytes_total":
                return sample.value
    raise AssertionError("no response_bytes metric")


async def http_chunks(response: aiohttp.ClientResponse) -> list[bytes]:
    """The body split where the server's HTTP chunks (one per transport write) end."""
    chunks: list[bytes] = []
    current = b""
    async for data, end_of_chunk in response.content.iter_chunks():
        current += data
        if end_of_chunk and current:
            chunks.append(current)
            current = b""
    if current:
        chunks.append(current)
    return chunks


@pytest.fixture
async def fast_engine() -> AsyncIterator[SampleEngine]:
    engine = SampleEngine(SampleEngineArgs())
    await engine.start(1)
    yield engine
    await engine.cleanup()


async def engine_lines(engine: SampleEngine, request: GenerateRequest) -> list[dict[str, Any]]:
    return [chunk async for chunk in engine.generate(request, Context())]  # type: ignore[misc]


async def test_chunks_that_come_out_together_share_a_write(fast_engine: SampleEngine) -> None:
    # A zero-delay engine emits 40 chunks within a fraction of the (long) interval: the
    # first is written at once, the rest together when the producer ends.
    plane, url = await serve(fast_engine, flush_interval=30.0)
    request: GenerateRequest = {"token_ids": [1, 7], "stop_conditions": {"max_tokens": 40}}
    try:
        started = time.monotonic()
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/generate", json=request) as response,
        ):
            chunks = await http_chunks(response)
        elapsed = time.monotonic() - started
    finally:
        await plane.stop()
    body = b"".join(chunks)
    lines = [json.loads(line) for line in body.splitlines()]
    assert lines == await engine_lines(fast_engine, request)
    # The first write cannot wait for the second chunk; it may hold two that were ready
    # in the same event-loop pass.
    assert len(chunks) == 2, [chunk.count(b"\n") for chunk in chunks]
    assert chunks[0].count(b"\n") <= 2
    assert elapsed < 15, "the last write must not wait for the interval once the stream ended"
    assert response_bytes(plane) == len(body)


async def test_sse_events_coalesce_and_keep_their_shape(fast_engine: SampleEngine) -> None:
    plane, url = await serve(fast_engine, flush_interval=30.0)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/chat/completions", json=body) as response,
        ):
            chunks = await http_chunks(response)
    finally:
        await plane.stop()
    assert len(chunks) == 2  # the role event at once; the rest together
    events = b"".join(chunks).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["usage"]["completion_tokens"] == 30
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[1:-1])
    assert fast_engine.tokenizer is not None
    assert len(fast_engine.tokenizer.encode(text, add_special_tokens=False)) == 30


async def test_a_chunk_after_a_pause_is_written_at_once() -> None:
    # Tokens 0.1 s apart, far more than the default interval: every one has its own write,
    # nothing waits for company.
    engine = SampleEngine(SampleEngineArgs(token_delay=0.1))
    await engine.start(1)
    plane, url = await serve(engine, flush_interval=0.001)
    request = {"token_ids": [1], "stop_conditions": {"max_tokens": 4}}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/generate", json=request) as response,
        ):
            chunks = await http_chunks(response)
    finally:
        await plane.stop()
        await engine.cleanup()
    assert [chunk.count(b"\n") for chunk in chunks] == [1, 1, 1, 1]


class EndlessEngine(LLMEngine):
    """Yields 4 KiB chunks as fast as it is asked for them, forever; counts them."""

    def __init__(self) -> None:
        self.tokenizer = None
        self.produced = 0

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[EndlessEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="t")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="endless")

    async def cleanup(self) -> None:
        return None

    async def generate(self, request: GenerateRequest, context: Any) -> AsyncGenerator[Any, None]:
        tokens = list(range(1000))
        while True:
            self.produced += 1
            yield {"token_ids": tokens, "index": 0}
            await asyncio.sleep(0)


async def test_a_client_that_does_not_read_pauses_the_engine() -> None:
    engine = EndlessEngine()
    plane, url = await serve(engine, flush_interval=0.001)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/generate", json={"token_ids": [1]}) as response,
        ):
            await response.content.readline()
            # The client reads nothing more. Once the kernel's socket buffers and our own
            # bounded buffer are full, the engine is not asked for more chunks.
            deadline = time.monotonic() + 60
            while True:
                before = engine.produced
                await asyncio.sleep(0.5)
                if engine.produced == before:
                    break
                assert time.monotonic() < deadline, f"the engine never paused ({before})"
            # ~4 KiB a chunk: what the kernel buffers plus our 64 KiB, nowhere near
            # unbounded.
            assert engine.produced < 20_000
    finally:
        await plane.stop()


async def test_output_buffer_pauses_the_producer_when_full() -> None:
    buffer = OutputBuffer(limit=10)
    buffer.data += b"12345"
    assert buffer.added() is None
    buffer.data += b"67890"
    full = buffer.added()
    assert full is not None
    waiting = asyncio.ensure_future(full)
    await asyncio.sleep(0)
    assert not waiting.done()
    assert buffer.take() == b"1234567890"
    await asyncio.wait_for(waiting, 1)
    assert buffer.data == b""


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", ["", "a", 'quote " and \\ backslash', "ünïcödé ✓\n", "</s>"])
@pytest.mark.parametrize("finish_reason", [None, "length", "cancelled"])
def test_chunk_template_encodes_the_event_dicts(
    chat: bool, text: str, finish_reason: str | None
) -> None:
    encoder = msgspec.json.Encoder()
    template = openai.ChunkTemplate("chatcmpl-1", 1700000000, "my/model", chat=chat)
    buffer = bytearray(b"before:")
    template.encode_into(buffer, text, finish_reason)
    if chat:
        delta = {"content": text} if text else {}
        event = openai.chat_chunk("chatcmpl-1", 1700000000, "my/model", delta, finish_reason)
    else:
        event = openai.completion_chunk("chatcmpl-1", 1700000000, "my/model", text, finish_reason)
    assert bytes(buffer) == b"before:" + encoder.encode(event)
