"""The vLLM engine's pure parts, in the project venv (no vLLM): request mapping, the KV-event
bridge's decoding, the stat logger, the engine's short name and the head_dim-64 tiny model.

The same parts run against real vLLM in tests/unit/test_vllm_engine.py.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
import zmq

from dynamo.common.backend import ComponentSnapshot, GenerateRequest
from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.engines.fpm import ForwardPassEmitter
from dynamo.engines.vllm import VllmEngine
from dynamo.engines.vllm.kv_bridge import KvEventBridge, block_hash, forward_batch
from dynamo.engines.vllm.sampling import requested_logprobs, sampling_kwargs
from dynamo.engines.vllm.stats import RankStats
from dynamo.runtime import cli
from dynamo.runtime.errors import RequestError
from support.tiny_model import TINY_MODEL_SEED, load_generator

pytestmark = pytest.mark.unit


# ----- sampling ----------------------------------------------------------------------------


def test_sampling_kwargs_map_every_supported_field() -> None:
    # The numbers keep their names and values in vLLM's SamplingParams.
    numbers = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.1,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
    }
    kwargs = sampling_kwargs(
        {
            "token_ids": [1, 2],
            "sampling_options": {
                **numbers,
                "logit_bias": {"5": -100, "7": 2.5},
                "guided_decoding": {"json": {"type": "object"}},
            },
            "stop_conditions": {
                "max_tokens": 9,
                "min_tokens": 2,
                "stop_token_ids": [5, 3],
                "stop_token_ids_hidden": [4],
                "ignore_eos": True,
            },
            "output_options": {"logprobs": 3},
        },
        default_max_tokens=100,
    )
    assert kwargs == {
        **numbers,
        "logit_bias": {5: -100.0, 7: 2.5},
        "structured_outputs": {"json": {"type": "object"}},
        "max_tokens": 9,
        "min_tokens": 2,
        "stop_token_ids": [3, 4, 5],
        "ignore_eos": True,
        "logprobs": 3,
        "detokenize": False,
    }


def test_sampling_kwargs_defaults_and_refusals() -> None:
    kwargs = sampling_kwargs({"token_ids": [1]}, default_max_tokens=100)
    assert kwargs["max_tokens"] == 100
    assert kwargs["temperature"] == 1.0
    assert kwargs["top_k"] == 0
    assert kwargs["logprobs"] is None
    assert kwargs["logit_bias"] is None
    assert kwargs["structured_outputs"] is None
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"sampling_options": {"top_p": 0}}, "top_p"),
        ({"sampling_options": {"temperature": 3}}, "temperature"),
        ({"stop_conditions": {"max_tokens": 0}}, "max_tokens"),
        ({"sampling_options": {"n": 2}}, "n"),
        ({"sampling_options": {"guided_decoding": {"backend": "x"}}}, "response_format"),
    ]
    for fields, param in refusals:
        with pytest.raises(RequestError) as info:
            sampling_kwargs(cast(GenerateRequest, {"token_ids": [1], **fields}), 10)
        assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize(
    ("value", "expected"), [(None, None), (False, None), (True, 0), (0, 0), (5, 5)]
)
def test_requested_logprobs(value: Any, expected: int | None) -> None:
    assert requested_logprobs({"logprobs": value}) == expected


def test_requested_logprobs_refuses_nonsense() -> None:
    with pytest.raises(RequestError, match=r"'logprobs'"):
        requested_logprobs({"logprobs": -1})


# ----- KV events ---------------------------------------------------------------------------


class Publisher:
    """The runtime's KvEventPublisher methods, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.arrived = threading.Event()

    def publish_stored(self, **kwargs: Any) -> None:
        self.calls.append(("stored", kwargs))
        self.arrived.set()

    def publish_removed(self, block_hashes: list[int]) -> None:
        self.calls.append(("removed", block_hashes))
        self.arrived.set()

    def publish_cleared(self) -> None:
        self.calls.append(("cleared", None))
        self.arrived.set()


# A batch as vLLM's ZmqEventPublisher encodes a KVEventBatch: an array [ts, events, rank],
# each event a map tagged by its class name.
DIGEST = bytes(range(32))
BATCH = [
    1.5,
    [
        {
            "type": "BlockStored",
            "block_hashes": [DIGEST, 42],
            "parent_block_hash": -1,
            "token_ids": list(range(8)),
            "block_size": 4,
            "lora_id": 3,
            "medium": "GPU",
            "lora_name": "sql@3",
        },
        {
            "type": "BlockStored",
            "block_hashes": [7],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4],
            "block_size": 4,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
        },
        {"type": "BlockRemoved", "block_hashes": [42], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ],
    0,
]


def test_forward_batch_maps_vllm_events_to_our_publisher() -> None:
    publisher = Publisher()
    names = {"sql@3": "sql"}
    sent = forward_batch(
        msgspec.msgpack.encode(BATCH), publisher, lambda name: names.get(name or "", name)
    )
    # The CPU-tier store is not a device block.
    assert sent == 3
    assert publisher.calls == [
        (
            "stored",
            {
                "token_ids": list(range(8)),
                "num_block_tokens": [4, 4],
                "block_hashes": [int.from_bytes(DIGEST, "big") & (2**64 - 1), 42],
                "parent_hash": 2**64 - 1,
                "lora_name": "sql",
            },
        ),
        ("removed", [42]),
        ("cleared", None),
    ]


def test_block_hash_is_the_low_64_bits() -> None:
    assert block_hash(b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x01\x02") == 0x102
    assert block_hash(-1) == 2**64 - 1
    assert block_hash(5) == 5


def test_bridge_forwards_what_a_zmq_publisher_sends(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv"
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    publisher = Publisher()
    bridge = KvEventBridge(endpoint, "kv-events", publisher, lambda name: name, dp_rank=0)
    bridge.start()
    try:
        payload = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}], 0])
        # PUB drops messages until the subscription has propagated: resend until one lands.
        for seq in range(200):
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
            if publisher.arrived.wait(0.05):
                break
        assert publisher.calls[0] == ("cleared", None)
    finally:
        bridge.stop()
        pub.close(0)


# ----- stats -------------------------------------------------------------------------------


def _stats(usage: float, running: int, waiting: int, details: Any = None, hits: int = 0) -> Any:
    prefix = SimpleNamespace(reset=False, queries=10 if hits else 0, hits=hits)
    return SimpleNamespace(
        kv_cache_usage=usage,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        prefix_cache_stats=prefix,
        iteration_details=details,
    )


def _details(ctx_reqs: int, ctx_tokens: int, gen_reqs: int) -> Any:
    return SimpleNamespace(
        num_ctx_requests=ctx_reqs,
        num_ctx_tokens=ctx_tokens,
        num_generation_requests=gen_reqs,
        num_generation_tokens=gen_reqs,
        elapsed_ms=12.0,
        is_dummy=False,
    )


class Snapshots:
    def __init__(self) -> None:
        self.seen: list[ComponentSnapshot] = []

    def publish(self, rank: int, snapshot: ComponentSnapshot) -> None:
        assert rank == snapshot.dp_rank
        self.seen.append(snapshot)


def test_rank_stats_publish_snapshots_and_forward_pass_metrics() -> None:
    sink: list[ForwardPassMetrics] = []
    emitter = ForwardPassEmitter(sink.append)
    emitter.worker_id = "9"
    snapshots = Snapshots()
    stats = RankStats(dp_rank=3, total_blocks=200, emitter=emitter, publisher=snapshots)
    stats.record(_stats(0.1, 1, 1, _details(1, 30, 0), hits=4), None)
    assert stats.kv_used_blocks == 20
    # Same usage and hit rate: no new snapshot.
    stats.record(_stats(0.1, 1, 1, _details(1, 30, 0), hits=4), None)
    stats.record(_stats(0.0, 0, 0, _details(0, 0, 2)), None)
    assert [(s.kv_used_blocks, s.kv_total_blocks, s.dp_rank) for s in snapshots.seen] == [
        (20, 200, 3),
        (0, 200, 3),
    ]
    assert snapshots.seen[0].kv_cache_hit_rate == pytest.approx(0.4)
    # What a prefill worker's drain waits on: the blocks in use after the last step.
    assert stats.kv_used_blocks == 0
    assert [m.counter_id for m in sink] == [1, 2, 3, 4]
    first = sink[0]
    assert first.worker_id == "9"
    assert first.dp_rank == 3
    assert first.wall_time == pytest.approx(0.012)
    assert first.scheduled_requests.num_prefill_requests == 1
    assert first.scheduled_requests.sum_prefill_tokens == 30
    assert first.scheduled_requests.sum_prefill_kv_tokens == 4
    assert first.queued_requests.num_prefill_requests == 1
    assert sink[2].scheduled_requests.num_decode_requests == 2
    # The step that emptied the rank is followed by one idle heartbeat.
    assert sink[3] == ForwardPassMetrics(worker_id="9", dp_rank=3, counter_id=4)


def test_rank_stats_survive_a_failing_publisher() -> None:
    class Broken:
        def publish(self, rank: int, snapshot: ComponentSnapshot) -> None:
            raise RuntimeError("boom")

    stats = RankStats(dp_rank=0, total_blocks=10, emitter=ForwardPassEmitter(), publisher=Broken())
    stats.record(_stats(0.5, 1, 0), None)  # logged, not raised


# ----- the engine's name and model ---------------------------------------------------------


def test_worker_knows_the_engine_by_its_short_name() -> None:
    assert cli.load_engine_class("vllm") is VllmEngine


def test_head_dim_64_tiny_model(tmp_path: Path) -> None:
    generator = load_generator()
    generator.write_tiny_model(tmp_path, TINY_MODEL_SEED, head_dim=64)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["head_dim"] == 64
    assert config["num_hidden_layers"] == 2
    for spec in generator.ADAPTERS:
        assert (tmp_path / "adapters" / spec.name / "adapter_model.safetensors").is_file()


async def test_without_vllm_the_engine_says_where_to_get_it() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable in this environment")
    with pytest.raises(ImportError, match="hack/vllm-venv"):
        await VllmEngine.from_args(["--model", "/nonexistent"])
