"""Upstream's ZMQ event plane: message frames on a real PUB/SUB pair on loopback, KV event
contents and block hashes, the sample engine's prefix cache, and the discovery records."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from dynamo.common.backend.publisher import ComponentSnapshot, PushSource
from dynamo.engines.sample import SampleEngine, SampleEngineArgs
from dynamo.engines.sample_kv import PrefixCache, block_id
from dynamo.runtime.context import Context
from dynamo.runtime.discovery.base import EndpointAddress, EventChannelAd, WorkerAdvertisement
from dynamo.runtime.discovery.file import FileBackend, encode_key
from dynamo.runtime.discovery.records import discovery_metadata, event_key
from dynamo.runtime.event_plane import EventPlane
from dynamo.runtime.event_plane.kv_events import hash_seed, tokens_hash

pytestmark = pytest.mark.unit

WORKER_ID = 0x49244D652B228010


class Subscriber:
    """A SUB socket on one channel, like upstream's router."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.setsockopt(zmq.RCVTIMEO, 5000)
        self.socket.connect(endpoint)

    def join(self, publish: Any) -> list[bytes]:
        """Publish probes until one arrives (ZMQ subscribers join late); its frames."""
        deadline = time.monotonic() + 5
        while True:
            publish()
            try:
                return self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                assert time.monotonic() < deadline, "the subscriber never joined"
                time.sleep(0.02)

    def close(self) -> None:
        self.socket.close()
        self._context.term()


@pytest.fixture
def plane() -> Iterator[EventPlane]:
    events = EventPlane(worker_id=WORKER_ID, bind_host="127.0.0.1", advertised_host="127.0.0.1")
    yield events
    events.close()


def decode(frames: list[bytes]) -> tuple[str, int, int, dict[str, Any], Any]:
    """Check the frame layout; (topic, publisher id, sequence, envelope, payload)."""
    topic, publisher, sequence, body = frames
    version, length = struct.unpack(">BI", body[:5])
    assert version == 1
    assert length == len(body) - 5
    envelope = msgspec.msgpack.decode(body[5:])
    payload_bytes = envelope["payload"]
    assert isinstance(payload_bytes, bytes)  # msgpack bin, as readers require
    publisher_id, seq = struct.unpack(">Q", publisher)[0], struct.unpack(">Q", sequence)[0]
    assert envelope["publisher_id"] == publisher_id
    assert envelope["sequence"] == seq
    assert envelope["topic"] == topic.decode()
    assert abs(envelope["published_at"] - time.time() * 1000) < 60_000
    return topic.decode(), publisher_id, seq, envelope, msgspec.msgpack.decode(payload_bytes)


def test_kv_events_on_the_wire(plane: EventPlane) -> None:
    publisher = plane.kv_events(dp_rank=0)
    [channel] = plane.advertised()
    assert channel.topic == "kv-events"
    assert channel.dp_rank == 0
    assert channel.endpoint.startswith("tcp://127.0.0.1:")
    assert 0 < channel.publisher_id < 2**53
    subscriber = Subscriber(channel.endpoint, "kv-events")
    try:
        # Probes until the subscriber is connected; each one is a real event.
        first = subscriber.join(lambda: publisher.publish_removed([-1]))
        _, publisher_id, sequence, _, payload = decode(first)
        assert publisher_id == channel.publisher_id
        [event] = payload
        assert event["worker_id"] == WORKER_ID
        assert event["storage_tier"] == "device"
        assert event["event"]["data"] == {"removed": {"block_hashes": [2**64 - 1]}}
        assert event["event"]["event_id"] == sequence  # one event per message, both from 0
        publisher.publish_stored(
            token_ids=list(range(32)),
            num_block_tokens=[16, 16],
            block_hashes=[4, 5],
            parent_hash=None,
        )
        publisher.publish_stored(
            token_ids=list(range(16)), num_block_tokens=[16], block_hashes=[6], parent_hash=5,
            lora_name="my-lora",
        )  # fmt: skip
        # Probes sent before the subscriber joined may still be queued: read past them.
        received: list[tuple[str, int, int, dict[str, Any], Any]] = []
        while len([m for m in received if "stored" in m[4][0]["event"]["data"]]) < 2:
            received.append(decode(subscriber.socket.recv_multipart()))
    finally:
        subscriber.close()
    sequences = [sequence] + [m[2] for m in received]
    assert sequences == list(range(sequence, sequence + len(sequences)))  # contiguous
    assert [m[4][0]["event"]["event_id"] for m in received] == sequences[1:]
    one, two = (m[4][0] for m in received[-2:])
    # Upstream's own event for blocks of the tokens 0..15 carried this tokens_hash.
    assert one["event"]["data"]["stored"] == {
        "parent_hash": None,
        "start_position": None,
        "blocks": [
            {"block_hash": 4, "tokens_hash": 15310707395893867146, "mm_extra_info": None},
            {"block_hash": 5, "tokens_hash": tokens_hash(range(16, 32)), "mm_extra_info": None},
        ],
    }
    lora_block = two["event"]["data"]["stored"]["blocks"][0]
    assert two["event"]["data"]["stored"]["parent_hash"] == 5
    assert lora_block["tokens_hash"] == tokens_hash(range(16), hash_seed("my-lora"))
    assert lora_block["tokens_hash"] != 15310707395893867146


def test_seeds_and_argument_checks(plane: EventPlane) -> None:
    assert hash_seed() == 1337
    assert hash_seed("a") != hash_seed("b")
    assert hash_seed(cache_salt="s") != 1337
    publisher = plane.kv_events(dp_rank=1)
    with pytest.raises(ValueError, match="one count per block"):
        publisher.publish_stored([1, 2], [2], [1, 2])
    with pytest.raises(ValueError, match="add up to 3"):
        publisher.publish_stored([1, 2], [3], [1])


def test_active_load_on_change_only(plane: EventPlane) -> None:
    load = plane.active_load()
    [channel] = plane.advertised()
    assert (channel.topic, channel.dp_rank) == ("kv_metrics", None)
    subscriber = Subscriber(channel.endpoint, "kv_metrics")
    used = iter(range(1, 1000))

    def snapshot(blocks: int) -> ComponentSnapshot:
        return ComponentSnapshot(
            kv_used_blocks=blocks, kv_total_blocks=100, gpu_cache_usage=0.1, dp_rank=0
        )

    try:
        frames = subscriber.join(lambda: load.publish(0, snapshot(next(used))))
        *_, payload = decode(frames)
        assert payload == {
            "worker_id": WORKER_ID,
            "dp_rank": 0,
            "active_decode_blocks": None,
            "active_prefill_tokens": None,
            "kv_used_blocks": payload["kv_used_blocks"],
        }
        # Probes may still be in flight: a marker value tells where they end.
        load.publish(0, snapshot(10_000))
        while payload["kv_used_blocks"] != 10_000:
            *_, payload = decode(subscriber.socket.recv_multipart())
        load.publish(0, snapshot(10_000))  # unchanged: nothing sent
        load.publish(0, snapshot(10_005))
        *_, payload = decode(subscriber.socket.recv_multipart())
        assert payload["kv_used_blocks"] == 10_005
    finally:
        subscriber.close()


class RecordingPublisher:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def publish_stored(self, **kwargs: Any) -> None:
        self.calls.append(("stored", kwargs))

    def publish_removed(self, block_hashes: list[int]) -> None:
        self.calls.append(("removed", {"block_hashes": block_hashes}))


def test_prefix_cache_reports_new_blocks_and_evictions() -> None:
    cache = PrefixCache(block_size=4, capacity=3)
    cache.publisher = events = RecordingPublisher()
    prompt = list(range(10))  # two full blocks; the last two tokens are not cached
    assert cache.admit(prompt, None) == 0
    first, second = block_id(None, [0, 1, 2, 3], None), None
    second = block_id(first, [4, 5, 6, 7], None)
    assert events.calls == [
        (
            "stored",
            {
                "token_ids": list(range(8)),
                "num_block_tokens": [4, 4],
                "block_hashes": [first, second],
                "parent_hash": None,
                "lora_name": None,
            },
        )
    ]
    events.calls.clear()
    # Same prefix, one more block: only the new block, with its parent.
    assert cache.admit(list(range(12)), None) == 2
    third = block_id(second, [8, 9, 10, 11], None)
    assert events.calls == [
        (
            "stored",
            {
                "token_ids": [8, 9, 10, 11],
                "num_block_tokens": [4],
                "block_hashes": [third],
                "parent_hash": second,
                "lora_name": None,
            },
        )
    ]
    events.calls.clear()
    # A different prompt (an adapter's) pushes out the least recently used block.
    assert cache.admit([0, 1, 2, 3], "my-lora") == 0
    assert events.calls[0] == ("removed", {"block_hashes": [first]})
    assert events.calls[1][1]["block_hashes"] == [block_id(None, [0, 1, 2, 3], "my-lora")]
    assert len(cache) == 3


async def test_sample_engine_push_sources_feed_the_publisher() -> None:
    engine = SampleEngine(SampleEngineArgs(kv_block_size=4, data_parallel_size=2))
    await engine.start(1)
    sources = await engine.kv_event_sources()
    assert [(type(s), s.dp_rank) for s in sources] == [(PushSource, 0), (PushSource, 1)]
    recorders = {source.dp_rank: RecordingPublisher() for source in sources}
    for source in sources:
        assert isinstance(source, PushSource)
        source.on_ready(recorders[source.dp_rank])
    request = {"token_ids": list(range(9)), "stop_conditions": {"max_tokens": 1}}
    request["routing"] = {"dp_rank": 1}
    async for _ in engine.generate(request, Context()):  # type: ignore[arg-type]
        pass
    assert recorders[0].calls == []
    [(kind, call)] = recorders[1].calls
    assert kind == "stored"
    assert call["num_block_tokens"] == [4, 4]
    await engine.cleanup()


def test_event_records_and_files(tmp_path: Path) -> None:
    address = EndpointAddress("dynamo", "sample", "generate")
    kv = EventChannelAd("kv-events", 0xE0CDC31BFD04B, "tcp://127.0.0.1:45069", dp_rank=0)
    load = EventChannelAd("kv_metrics", 0x780F883CB056B, "tcp://127.0.0.1:45070")
    adv = WorkerAdvertisement(
        address=address,
        instance_id=5270422560841039888,
        served_model_name="m",
        model="m",
        transport={"tcp": "127.0.0.1:1/x"},
        event_channels=(kv, load),
    )
    metadata = discovery_metadata(adv)
    key = "namespace/dynamo/component/sample/endpoint/generate/topic/kv-events/e0cdc31bfd04b"
    assert event_key(address, "kv-events", kv.publisher_id) == key
    scope = {"kind": "endpoint", "endpoint": {"namespace": "dynamo", "component": "sample",
                                              "name": "generate"}}  # fmt: skip
    assert metadata["event_channels"][key] == {
        "type": "EventChannel",
        "scope": scope,
        "topic": "kv-events",
        "instance_id": kv.publisher_id,
        "transport": {"kind": "Zmq", "config": {"endpoint": "tcp://127.0.0.1:45069"}},
    }
    assert metadata["event_sources"] == {
        key: {
            "type": "EventSource",
            "scope": scope,
            "topic": "kv-events",
            "publisher_id": kv.publisher_id,
            "metadata": {
                "kv_state_endpoint": scope["endpoint"],
                "worker": {"worker_id": 5270422560841039888, "dp_rank": 0},
                "publisher_id": kv.publisher_id,
            },
        }
    }
    assert len(metadata["event_channels"]) == 2
    assert event_key(address, "a.b", 1).endswith("/topic/a%2Eb/1")
    # The file names upstream's reader decodes back to these keys.
    assert encode_key(key) == (
        "namespace%2Fdynamo%2Fcomponent%2Fsample%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents"
        "%2Fe0cdc31bfd04b"
    )


def record_files(root: Path) -> set[str]:
    return {path.parent.name + "/" + path.name for path in root.glob("v1/*/*")}


async def test_file_backend_writes_event_buckets(tmp_path: Path) -> None:
    adv = WorkerAdvertisement(
        address=EndpointAddress("dynamo", "backend", "generate"),
        instance_id=7,
        served_model_name="m",
        model="m",
        transport={"tcp": "127.0.0.1:1/x"},
        event_channels=(EventChannelAd("kv-events", 9, "tcp://127.0.0.1:2", dp_rank=0),),
    )
    backend = FileBackend(tmp_path)
    await backend.register(adv)
    names = record_files(tmp_path)
    event_file = encode_key(
        "namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/9"
    )
    assert f"event_channels/{event_file}" in names
    assert f"event_sources/{event_file}" in names
    await backend.close()
    assert not record_files(tmp_path)


def test_dropped_kv_events_are_counted() -> None:
    dropped: list[int] = []
    plane = EventPlane(
        worker_id=7,
        bind_host="127.0.0.1",
        advertised_host="127.0.0.1",
        on_kv_event_dropped=lambda: dropped.append(1),
    )
    publisher = plane.kv_events(0)
    load = plane.active_load()
    publisher.publish_cleared()
    assert dropped == []  # sent (a PUB socket without subscribers discards it, as upstream)
    plane.close()
    publisher.publish_cleared()
    load.publish(
        0, ComponentSnapshot(kv_used_blocks=1, kv_total_blocks=2, gpu_cache_usage=0.5, dp_rank=0)
    )
    assert dropped == [1]  # only the KV-events channel counts
