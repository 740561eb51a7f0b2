"""Upstream's TCP request plane served by `TcpRequestPlane`, on loopback, in-process.

The frontend's half is `support.tcp_frontend.FakeFrontend` (the real frontend is exercised in
tests/e2e/test_upstream_frontend.py); the engine is the real sample engine.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.common.backend import EngineConfig, GenerateChunk, LLMEngine
from dynamo.common.backend.engine import GenerateRequest
from dynamo.engines.sample import _ALPHABET, SampleEngine, SampleEngineArgs, output_seed
from dynamo.runtime.discovery.base import EndpointAddress, WorkerAdvertisement
from dynamo.runtime.discovery.records import endpoint_record
from dynamo.runtime.inflight import InflightTracker
from dynamo.runtime.metrics import RuntimeMetrics, auto_labels
from dynamo.runtime.models import ServedModels
from dynamo.runtime.request_limits import ALL_FEATURES, RequestLimits
from dynamo.runtime.serving import Serving
from dynamo.runtime.settings import RuntimeSettings
from dynamo.runtime.tcp_plane import TcpRequestPlane, address, codec, messages
from support.tcp_frontend import FakeFrontend

pytestmark = pytest.mark.unit

PATH = "1f/dynamo/backend/generate"


def expected_tokens(prompt: list[int], count: int, adapter: str | None = None) -> list[int]:
    """What the sample engine answers for `prompt` (its documented determinism)."""
    rng = random.Random(output_seed(prompt, adapter))
    return [rng.choice(_ALPHABET) for _ in range(count)]


def request(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A PreprocessedRequest as upstream's frontend sends it (the fields that matter)."""
    return {
        "model": "sample-model",
        "token_ids": prompt,
        "stop_conditions": {"max_tokens": max_tokens, "stop": None, "ignore_eos": None},
        "sampling_options": {"temperature": 0.5, "seed": None},
        "output_options": {"logprobs": None},
        "eos_token_ids": [2],
        "annotations": [],
        "routing": {},
        **extra,
    }


class Setup:
    def __init__(self, engine: Any, plane: TcpRequestPlane, tracker: InflightTracker, port: int):
        self.engine = engine
        self.plane = plane
        self.tracker = tracker
        self.port = port


@pytest.fixture
async def sample() -> AsyncIterator[SampleEngine]:
    engine = SampleEngine(SampleEngineArgs(token_delay=0.0))
    await engine.start(1)
    yield engine
    await engine.cleanup()


async def serve(engine: Any) -> Setup:
    tracker = InflightTracker()
    plane = TcpRequestPlane(
        Serving(
            engine,
            models=ServedModels(base="sample-model", adapters={"my-lora": 1}),
            metrics=RuntimeMetrics(auto_labels("dynamo", "backend", "generate", 0x1F)),
            tracker=tracker,
        ),
        endpoint_path=PATH,
    )
    port = await plane.start("127.0.0.1", 0)
    return Setup(engine, plane, tracker, port)


@pytest.fixture
async def frontend() -> AsyncIterator[FakeFrontend]:
    fake = FakeFrontend()
    await fake.start()
    yield fake
    await fake.close()


async def test_pipelined_requests_are_acked_in_order_and_streamed(
    sample: SampleEngine, frontend: FakeFrontend
) -> None:
    setup = await serve(sample)
    await frontend.connect(setup.port)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    streams = [frontend.expect() for _ in prompts]
    frames = [frontend.frame(PATH, request(p, 4), s) for p, s in zip(prompts, streams, strict=True)]
    acks = await frontend.send(
        *frames, frontend.frame("nope/x", request([1], 1), frontend.expect())
    )
    assert acks == ["", "", "", "Server unavailable: unknown endpoint nope/x"]
    for prompt, stream in zip(prompts, streams, strict=True):
        await asyncio.wait_for(stream.closed.wait(), 10)
        assert stream.handshake == {"subject": stream.subject, "stream_type": "response"}
        assert stream.prologue == {"error": None}
        assert stream.token_ids() == expected_tokens(prompt, 4)
        last = stream.outputs()[-1]
        assert last["finish_reason"] == "length"
        assert last["completion_usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 4,
            "total_tokens": len(prompt) + 4,
        }
        assert all("finish_reason" not in out for out in stream.outputs()[:-1])
        assert stream.complete_final
        assert stream.sentinel
    await setup.plane.stop()


async def test_json_codec_when_the_control_message_names_none(sample: SampleEngine) -> None:
    setup = await serve(sample)
    fake = FakeFrontend("json")
    await fake.start()
    await fake.connect(setup.port)
    stream = fake.expect()
    assert await fake.send(fake.frame(PATH, request([3, 4], 3), stream, codec_name="absent")) == [
        ""
    ]
    await asyncio.wait_for(stream.closed.wait(), 10)
    assert stream.token_ids() == expected_tokens([3, 4], 3)
    assert stream.sentinel
    await fake.close()
    await setup.plane.stop()


async def test_lora_requests_reach_the_adapter(frontend: FakeFrontend) -> None:
    engine = RecordingEngine()
    setup = await serve(engine)
    await frontend.connect(setup.port)
    stream = frontend.expect()
    body = request([4], 2, model="my-lora", routing={"lora_name": "my-lora"})
    await frontend.send(frontend.frame(PATH, body, stream))
    await asyncio.wait_for(stream.closed.wait(), 10)
    assert engine.requests[0]["model"] == "my-lora"
    # Counted under the adapter the routing named (the engine's one token).
    tokens = [
        sample
        for family in text_string_to_metric_families(setup.plane.serving.metrics.exposition())
        for sample in family.samples
        if sample.name == "dynamo_worker_output_tokens_total"
    ]
    assert [(t.labels["model"], t.labels["adapter"], t.value) for t in tokens] == [
        ("sample-model", "my-lora", 1)
    ]
    await setup.plane.stop()


async def test_kill_stops_the_engine_and_ends_without_sentinel(frontend: FakeFrontend) -> None:
    engine = SampleEngine(SampleEngineArgs(token_delay=0.01))
    await engine.start(1)
    setup = await serve(engine)
    await frontend.connect(setup.port)
    stream = frontend.expect(kill_after=3)
    await frontend.send(frontend.frame(PATH, request([5], 10_000), stream))
    await asyncio.wait_for(stream.closed.wait(), 10)
    # The engine was told: its request is aborted and no longer running.
    assert len(engine.aborted) == 1
    assert await asyncio.wait_for(setup.tracker.wait_idle(5), 6)
    assert not stream.complete_final
    assert not stream.sentinel
    assert len(stream.items) < 50
    assert setup.plane.serving.metrics.cancellations._value.get() == 1
    await setup.plane.stop()
    await engine.cleanup()


async def test_frontend_closing_the_stream_cancels(frontend: FakeFrontend) -> None:
    engine = SampleEngine(SampleEngineArgs(token_delay=0.01))
    await engine.start(1)
    setup = await serve(engine)
    await frontend.connect(setup.port)
    stream = frontend.expect(close_after=2)
    # No kill frame, the connection just ends: same as a kill.
    await frontend.send(frontend.frame(PATH, request([5], 10_000), stream))
    await asyncio.wait_for(stream.closed.wait(), 10)
    assert await setup.tracker.wait_idle(5)
    assert engine.aborted
    await setup.plane.stop()
    await engine.cleanup()


async def test_draining_worker_refuses_with_unavailable(
    sample: SampleEngine, frontend: FakeFrontend
) -> None:
    setup = await serve(sample)
    await frontend.connect(setup.port)
    setup.tracker.refuse_new()
    acks = await frontend.send(frontend.frame(PATH, request([1], 1), frontend.expect()))
    assert acks[0].startswith("Server unavailable: the worker is shutting down")
    await setup.plane.stop()


async def test_errors_travel_in_band(frontend: FakeFrontend) -> None:
    setup = await serve(FailingEngine())
    await frontend.connect(setup.port)
    failing, bad_model, bad_body = frontend.expect(), frontend.expect(), frontend.expect()
    garbage = frontend.frame(PATH, {"token_ids": "nope"}, bad_body)
    await frontend.send(
        frontend.frame(PATH, request([1], 3), failing),
        frontend.frame(PATH, request([1], 3, model="other"), bad_model),
        garbage,
    )
    for stream in (failing, bad_model, bad_body):
        await asyncio.wait_for(stream.closed.wait(), 10)
        assert stream.complete_final
        assert stream.sentinel
    # An engine failure after one token: the token, then an Unknown error (HTTP 500).
    assert failing.outputs() == [{"token_ids": [9], "index": 0}]
    error = failing.items[-1]["data"]
    assert error["event"] == "error"
    assert error["error"] == {"error_type": "Unknown", "message": "engine error: boom"}
    # Requests the worker cannot serve: InvalidArgument (HTTP 400).
    for stream, fragment in ((bad_model, "does not exist"), (bad_body, "token_ids")):
        [item] = stream.items
        assert item["data"]["error"]["error_type"] == {"Backend": "InvalidArgument"}
        assert fragment in item["data"]["error"]["message"]
    await setup.plane.stop()


async def test_malformed_frames_close_the_connection_only(sample: SampleEngine) -> None:
    setup = await serve(sample)
    reader, writer = await asyncio.open_connection("127.0.0.1", setup.port)
    # A frame claiming a payload over the size limit.
    writer.write(struct.pack(">H", 1) + b"x" + struct.pack(">H", 2) + b"{}")
    writer.write(struct.pack(">I", codec.DEFAULT_MAX_MESSAGE_BYTES + 1))
    await writer.drain()
    assert await reader.read() == b""  # closed without an ACK
    writer.close()
    # The listener still serves others.
    fake = FakeFrontend()
    await fake.start()
    await fake.connect(setup.port)
    stream = fake.expect()
    assert await fake.send(fake.frame(PATH, request([2], 1), stream)) == [""]
    await asyncio.wait_for(stream.closed.wait(), 10)
    assert stream.sentinel
    await fake.close()
    await setup.plane.stop()


def test_two_part_round_trip_and_errors() -> None:
    message = codec.encode_two_part(b'{"a":1}', b"body")
    assert message[:24] == struct.pack(">QQQ", 7, 4, 0)
    assert codec.decode_two_part(message) == (b'{"a":1}', b"body")
    with pytest.raises(codec.FrameError, match="declares"):
        codec.decode_two_part(message + b"x")
    with pytest.raises(codec.FrameError, match="shorter"):
        codec.decode_two_part(b"\0" * 5)


def test_control_message_parsing() -> None:
    info = '{"address":"127.0.0.1:42205","subject":"s-1","context":"c-1","stream_type":"response"}'
    header = (
        '{"id":"c-1","request_type":"single_in","response_type":"many_out",'
        '"payload_codec":"msgpack","connection_info":{"transport":"tcp_server","info":'
        + json.dumps(info)
        + "}}"
    ).encode()
    control = messages.parse_control(header)
    assert (control.request_id, control.codec, control.address, control.subject) == (
        "c-1",
        "msgpack",
        "127.0.0.1:42205",
        "s-1",
    )
    assert messages.split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(messages.ControlError, match="quic"):
        messages.parse_control(b'{"connection_info":{"transport":"quic","info":"{}"}}')
    with pytest.raises(messages.ControlError, match="many_in"):
        messages.parse_control(b'{"request_type":"many_in"}')
    with pytest.raises(messages.ControlError, match="payload_codec"):
        messages.parse_control(b'{"payload_codec":"cbor"}')


def test_output_items_follow_upstream_llm_engine_output() -> None:
    assert messages.output_item({"token_ids": [1], "index": 0}) == {
        "data": {"data": {"token_ids": [1], "index": 0}},
        "complete_final": False,
    }
    last = messages.output_item(
        {
            "token_ids": [],
            "index": 0,
            "finish_reason": "abort",
            "completion_usage": {"prompt_tokens": 3},  # partial: the frontend would refuse it
            "private": "dropped",
        }
    )
    assert last["data"]["data"] == {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
    reasons = {
        "eos": "eos",
        "length": "length",
        "error": "error: the engine reported an error",
        "error: oom": "error: oom",
        "weird": "stop",
    }
    for given, sent in reasons.items():
        item = messages.output_item({"token_ids": [], "index": 0, "finish_reason": given})
        assert item["data"]["data"]["finish_reason"] == sent


def test_addresses_and_the_endpoint_record() -> None:
    assert address.bind_host(None) == "0.0.0.0"
    assert address.bind_host("10.1.2.3") == "10.1.2.3"
    assert address.advertised_host(None, {}) == "127.0.0.1"
    assert address.advertised_host("0.0.0.0", {"POD_IP": "198.18.0.9"}) == "198.18.0.9"
    assert address.advertised_host("localhost", {}) == "127.0.0.1"
    assert address.transport_address("::1", 9, "p") == "[::1]:9/p"
    path = address.endpoint_path(0x49244D652B228010, "dynamo", "sample", "generate")
    assert path == "49244d652b228010/dynamo/sample/generate"
    adv = WorkerAdvertisement(
        address=EndpointAddress("dynamo", "backend", "generate"),
        instance_id=31,
        served_model_name="m",
        model="m",
        transport={"tcp": address.transport_address("127.0.0.1", 45047, PATH)},
        request_plane_codec="msgpack",
    )
    assert endpoint_record(adv) == {
        "type": "Endpoint",
        "component": "backend",
        "endpoint": "generate",
        "namespace": "dynamo",
        "instance_id": 31,
        "transport": {"tcp": "127.0.0.1:45047/1f/dynamo/backend/generate"},
        "device_type": "cpu",
        "request_plane_codec": "msgpack",
    }
    # Without the TCP plane the codec is not advertised.
    http_only = WorkerAdvertisement(
        address=adv.address, instance_id=31, served_model_name="m", model="m", transport={}
    )
    assert "request_plane_codec" not in endpoint_record(http_only)


def test_request_plane_setting() -> None:
    assert RuntimeSettings.from_env({}).request_plane == "tcp"
    assert RuntimeSettings().request_plane == "tcp"
    settings = RuntimeSettings.from_env(
        {"DYN_REQUEST_PLANE": "TCP", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RPC_PORT": "7"}
    )
    assert (settings.request_plane, settings.tcp_host, settings.tcp_port) == ("tcp", "127.0.0.1", 7)
    with pytest.raises(ValueError, match="DYN_REQUEST_PLANE='nats'"):
        RuntimeSettings.from_env({"DYN_REQUEST_PLANE": "nats"})


class RecordingEngine(LLMEngine):
    """Answers one token and remembers the requests it got."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> Any:
        raise NotImplementedError

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="sample-model")

    async def generate(
        self, request: GenerateRequest, context: Any
    ) -> AsyncGenerator[GenerateChunk, None]:
        self.requests.append(request)
        yield {"token_ids": [7], "index": 0, "finish_reason": "length"}

    async def cleanup(self) -> None:
        return None


class FailingEngine(RecordingEngine):
    """One token, then an exception."""

    async def generate(
        self, request: GenerateRequest, context: Any
    ) -> AsyncGenerator[GenerateChunk, None]:
        yield {"token_ids": [9], "index": 0}
        raise RuntimeError("boom")


async def test_requests_past_the_engines_limits_are_invalid_argument(
    sample: SampleEngine, frontend: FakeFrontend
) -> None:
    """What the engine publishes (`RequestLimits`) is checked on this plane too: the issue's
    three bad requests are upstream's InvalidArgument (the frontend's 400), never Unknown."""
    tracker = InflightTracker()
    limits = RequestLimits(context_length=16, vocab_size=300, features=ALL_FEATURES)
    plane = TcpRequestPlane(
        Serving(
            sample,
            models=ServedModels(base="sample-model"),
            metrics=RuntimeMetrics(auto_labels("dynamo", "backend", "generate", 0x1F)),
            tracker=tracker,
            limits=limits,
        ),
        endpoint_path=PATH,
    )
    port = await plane.start("127.0.0.1", 0)
    await frontend.connect(port)
    long_prompt, top_p, vocabulary = frontend.expect(), frontend.expect(), frontend.expect()
    bad_top_p = request([1], 3)
    bad_top_p["sampling_options"] = {"temperature": 0.5, "top_p": 2.0, "seed": None}
    await frontend.send(
        frontend.frame(PATH, request([1] * 40, 3), long_prompt),
        frontend.frame(PATH, bad_top_p, top_p),
        frontend.frame(PATH, request([99_999_999], 3), vocabulary),
    )
    fragments = [
        (long_prompt, "maximum context length"),
        (top_p, "'top_p'"),
        (vocabulary, "vocabulary"),
    ]
    for stream, fragment in fragments:
        await asyncio.wait_for(stream.closed.wait(), 10)
        [item] = stream.items
        assert item["data"]["error"]["error_type"] == {"Backend": "InvalidArgument"}
        assert fragment in item["data"]["error"]["message"]
    await plane.stop()
