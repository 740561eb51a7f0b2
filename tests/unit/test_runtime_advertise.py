"""What discovery publishes (`advertise.py`) and the canary health checks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from dynamo.common.backend import EngineConfig, GenerateRequest, LlmRegistration, WorkerConfig
from dynamo.common.backend.model_input import ModelInput
from dynamo.common.constants import DisaggregationMode
from dynamo.engines.sample import SampleEngine, SampleEngineArgs
from dynamo.runtime.canary import Canary
from dynamo.runtime.discovery.records import metadata_for
from dynamo.runtime.health import HealthState
from dynamo.runtime.registration import advertise

pytestmark = pytest.mark.unit


def test_served_name_precedence() -> None:
    engine = EngineConfig(model="/models/llama", served_model_name="llama")
    assert advertise.served_name(WorkerConfig(namespace="n"), engine) == "llama"
    config = WorkerConfig(namespace="n", served_model_name="prod-llama")
    assert advertise.served_name(config, engine) == "prod-llama"
    assert advertise.served_name(WorkerConfig(namespace="n"), EngineConfig(model="m")) == "m"


@pytest.mark.parametrize(
    ("types", "expected"),
    [
        ("chat,completions", ["Chat", "Completions"]),
        (" Completions , CHAT ", ["Chat", "Completions"]),
        ("embeddings", ["Embedding"]),
        ("image,video,audio,tensor", ["TensorBased", "Images", "Audios", "Videos"]),
    ],
)
def test_endpoint_types(types: str, expected: list[str]) -> None:
    assert advertise.parse_endpoint_types(types) == expected


def test_endpoint_types_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        advertise.parse_endpoint_types(" , ")
    with pytest.raises(ValueError, match=r"unknown type\(s\) \['sql'\]"):
        advertise.parse_endpoint_types("chat,sql")


def test_model_type_by_mode() -> None:
    def mode(value: DisaggregationMode) -> str:
        return advertise.model_type(WorkerConfig(namespace="n", disaggregation_mode=value))

    assert mode(DisaggregationMode.AGGREGATED) == "Chat | Completions"
    assert mode(DisaggregationMode.DECODE) == "Chat | Completions"
    assert mode(DisaggregationMode.PREFILL) == "Prefill"
    assert mode(DisaggregationMode.ENCODE) == ""


def test_advertisement_contents() -> None:
    config = WorkerConfig(namespace="ns", component="comp", endpoint="ep", reasoning_parser="r1")
    engine = EngineConfig(
        model="/m",
        served_model_name="m",
        llm=LlmRegistration(
            context_length=2048,
            kv_cache_block_size=32,
            total_kv_blocks=100,
            max_num_seqs=8,
            data_parallel_size=2,
            data_parallel_start_rank=2,
            bootstrap_host="10.0.0.1",
            bootstrap_port=9000,
        ),
    )
    adv = advertise.build_advertisement(
        config,
        engine,
        instance_id=77,
        http_url="http://10.0.0.2:8000",
        runtime_data={"token_budget": {"combined_limit": 9}},
        taints=["b", "a", "b"],
        adapters={"x": (5, "s3://b/x")},
        max_loras=3,
    )
    assert (adv.address.namespace, adv.address.component, adv.address.endpoint) == (
        "ns",
        "comp",
        "ep",
    )
    assert adv.transport == {"http": "http://10.0.0.2:8000"}
    assert adv.kv_cache_block_size == 32
    assert adv.model_input == ModelInput.Tokens.name
    rc = adv.runtime_config
    assert rc["context_length"] == 2048
    assert (rc["data_parallel_size"], rc["data_parallel_start_rank"]) == (2, 2)
    assert rc["disaggregated_endpoint"] == {"bootstrap_host": "10.0.0.1", "bootstrap_port": 9000}
    assert rc["taints"] == ["a", "b"]
    assert rc["reasoning_parser"] == "r1"
    assert rc["max_gpu_lora_count"] == 3
    assert [(a.lora_name, a.lora_id, a.source_uri) for a in adv.adapters] == [("x", 5, "s3://b/x")]
    # The discovery records accept it (the adapter gets its own card).
    metadata = metadata_for(adv)
    assert len(metadata["model_cards"]) == 2


def test_advertise_host() -> None:
    assert advertise.advertise_host("10.1.1.1", {}) == "10.1.1.1"
    assert advertise.advertise_host("0.0.0.0", {"POD_IP": "198.18.0.7"}) == "198.18.0.7"
    assert advertise.advertise_host("0.0.0.0", {})  # this host's address


class FlakyEngine(SampleEngine):
    def __init__(self) -> None:
        super().__init__(SampleEngineArgs())
        self.broken = True

    async def generate(self, request: GenerateRequest, context: Any) -> AsyncGenerator[Any, None]:
        if self.broken:
            raise RuntimeError("CUDA error")
        async for chunk in super().generate(request, context):
            yield chunk


async def test_canary_probes_and_recovers() -> None:
    engine = FlakyEngine()
    await engine.start(1)
    health = HealthState(starting_ready=True)
    payload = await engine.health_check_payload()
    assert payload is not None
    canary = Canary(
        engine, health=health, endpoint="generate", payload=payload, wait_secs=0.05, timeout_secs=1
    )
    try:
        assert not health.is_healthy()  # a target starts notready
        assert await canary.probe() is False
        engine.broken = False
        assert await canary.probe() is True
        engine.broken = True
        canary.start()
        for _ in range(500):
            if not health.is_healthy():
                break
            await asyncio.sleep(0.01)
        assert not health.is_healthy()
        engine.broken = False
        canary.record_success()  # real traffic
        assert health.is_healthy()
    finally:
        await canary.stop()
        await canary.stop()
        await engine.cleanup()
