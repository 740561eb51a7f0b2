"""Read-only views of DynamoWorkerMetadata (upstream's per-pod discovery record): they read what
the operator shows in status and tolerate fields and nulls they do not know."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_operator.api.metadata import DiscoveryMetadata, DynamoWorkerMetadata

pytestmark = pytest.mark.unit

INSTANCE_ID = 1186445869714687
PREFIX = "dynamo/worker/generate/43710f49c0cff"


def base_card(**runtime: Any) -> dict[str, Any]:
    runtime_config = {
        "context_length": 2048,
        "total_kv_blocks": 1000,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "tool_call_arguments_format": "json_string",
        "data_parallel_start_rank": 2,
        "data_parallel_size": 2,
        "enable_local_indexer": False,
        "taints": ["dynamo.topology/zone=a", "gpu=h100"],
        "runtime_data": {
            "token_budget": {
                "combined_limit": 4096,
                "reject_prompt_overflow": True,
                "reject_total_overflow": False,
            },
            "native_offloading_capacity": {"total_tokens": 100000},
        },
        "max_gpu_lora_count": 4,
    }
    runtime_config.update(runtime)
    return {
        "type": "Model",
        "namespace": "dynamo",
        "component": "worker",
        "endpoint": "generate",
        "instance_id": INSTANCE_ID,
        "card_json": {
            "display_name": "Qwen/Qwen3-0.6B",
            "slug": "qwen_qwen3-0_6b",
            "source_path": "/models/qwen",
            "kv_cache_block_size": 16,
            "migration_limit": 0,
            "model_type": "Chat | Completions",
            "model_input": "Tokens",
            "worker_type": "aggregated",
            "needs": [],
            "aliases": ["qwen3"],
            "model_info": {"hf_config_json": {"path": "/x", "checksum": "blake3:00", "size": 1}},
            "runtime_config": runtime_config,
        },
    }


def adapter_card(name: str, slug: str) -> dict[str, Any]:
    card = base_card()
    card["model_suffix"] = slug
    card["card_json"] = {
        **card["card_json"],
        "display_name": name,
        "slug": slug,
        "lora": {"name": name, "max_gpu_lora_count": 4},
        "user_data": {"lora_adapter": True, "lora_id": 12345},
    }
    return card


def record(**data: Any) -> dict[str, Any]:
    spec_data = {
        "endpoints": {
            PREFIX: {
                "type": "Endpoint",
                "namespace": "dynamo",
                "component": "worker",
                "endpoint": "generate",
                "instance_id": INSTANCE_ID,
                "transport": {"tcp": "198.18.0.7:9345/43710f49c0cff/dynamo/worker/generate"},
                "request_plane_codec": "msgpack",
            }
        },
        "model_cards": {
            PREFIX: base_card(),
            f"{PREFIX}/sql-expert": adapter_card("SQL-Expert.v1", "sql-expert_v1"),
            f"{PREFIX}/chat-tone": adapter_card("chat-tone", "chat-tone"),
        },
        "event_channels": {
            "namespace/dynamo/component/worker/endpoint/generate/topic/kv-events/e0cdc31bfd04b": {
                "type": "EventChannel",
                "scope": {
                    "kind": "endpoint",
                    "endpoint": {"namespace": "dynamo", "component": "worker", "name": "generate"},
                },
                "topic": "kv-events",
                "instance_id": 3954789540941899,
                "transport": {"kind": "Zmq", "config": {"endpoint": "tcp://198.18.0.7:45069"}},
                "namespace": "dynamo",
                "component": "worker",
            }
        },
        "event_sources": {},
    }
    spec_data.update(data)
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoWorkerMetadata",
        "metadata": {
            "name": "llm-7d9f-abcde",
            "namespace": "ns1",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": "llm-7d9f-abcde", "uid": "u"}
            ],
            "managedFields": [{"manager": "dynamo-worker"}],
        },
        "spec": {"data": spec_data},
    }


def test_reads_the_facts_the_operator_shows() -> None:
    dwm = DynamoWorkerMetadata.model_validate(record())
    assert dwm.pod_name == "llm-7d9f-abcde"
    assert dwm.served_model_names == ["Qwen/Qwen3-0.6B", "qwen3"]
    assert dwm.loaded_adapters == ["SQL-Expert.v1", "chat-tone"]
    assert dwm.dp_ranks == [2, 3]
    assert dwm.taints == ["dynamo.topology/zone=a", "gpu=h100"]
    config = dwm.runtime_config
    assert config is not None
    assert config.caller_taints == ["gpu=h100"]
    assert (config.context_length, config.total_kv_blocks, config.max_num_seqs) == (2048, 1000, 64)
    assert config.max_gpu_lora_count == 4
    budget = dwm.token_budget
    assert budget is not None
    assert (budget.combined_limit, budget.reject_prompt_overflow, budget.reject_total_overflow) == (
        4096,
        True,
        False,
    )
    base = dwm.base_card
    assert base is not None
    assert not base.is_adapter
    assert [c.model_suffix for c in dwm.spec.data.adapter_cards()] == ["chat-tone", "sql-expert_v1"]
    endpoint = dwm.spec.data.endpoints[PREFIX]
    assert endpoint.instance_id == INSTANCE_ID
    assert endpoint.request_plane_codec == "msgpack"
    channel = next(iter(dwm.spec.data.event_channels.values()))
    assert channel.topic == "kv-events"


def test_nulls_and_missing_maps_read_as_empty() -> None:
    data = DiscoveryMetadata.model_validate(
        {"endpoints": None, "model_cards": None, "event_channels": None}
    )
    assert (data.endpoints, data.model_cards, data.event_channels, data.event_sources) == (
        {},
        {},
        {},
        {},
    )
    dwm = DynamoWorkerMetadata.model_validate({"metadata": {"name": "p"}, "spec": {"data": None}})
    assert (dwm.base_card, dwm.token_budget, dwm.taints, dwm.dp_ranks) == (None, None, [], [])
    assert dwm.loaded_adapters == []


def test_card_defaults_when_runtime_config_is_sparse() -> None:
    card = base_card()
    card["card_json"]["runtime_config"] = None
    dwm = DynamoWorkerMetadata.model_validate(record(model_cards={PREFIX: card}))
    config = dwm.runtime_config
    assert config is not None
    assert (config.data_parallel_start_rank, config.data_parallel_size, config.taints) == (0, 1, [])
    assert dwm.dp_ranks == [0]
    assert dwm.token_budget is None


@pytest.mark.parametrize(
    "budget",
    [
        "not an object",
        {"combined_limit": -1},
        {"combined_limit": 2**32},
        {"reject_prompt_overflow": True},
    ],
)
def test_an_invalid_token_budget_is_not_shown(budget: Any) -> None:
    # The frontend ignores an invalid budget; reporting one would claim a limit nobody enforces.
    card = base_card(runtime_data={"token_budget": budget})
    dwm = DynamoWorkerMetadata.model_validate(record(model_cards={PREFIX: card}))
    assert dwm.token_budget is None


def test_unknown_fields_and_types_from_newer_workers_are_ignored() -> None:
    manifest = record()
    manifest["spec"]["data"]["future_map"] = {"x": 1}
    card = copy.deepcopy(base_card())
    card["card_json"]["brand_new_field"] = {"nested": True}
    card["card_json"]["runtime_config"]["brand_new_knob"] = 7
    card["unexpected"] = "value"
    manifest["spec"]["data"]["model_cards"] = {PREFIX: card}
    dwm = DynamoWorkerMetadata.model_validate(manifest)
    assert dwm.served_model_names == ["Qwen/Qwen3-0.6B", "qwen3"]


def test_views_are_read_only() -> None:
    dwm = DynamoWorkerMetadata.model_validate(record())
    with pytest.raises(ValidationError):
        dwm.metadata.name = "other"  # type: ignore[misc]


def test_a_card_without_its_name_is_refused() -> None:
    card = base_card()
    del card["card_json"]["display_name"]
    with pytest.raises(ValidationError):
        DynamoWorkerMetadata.model_validate(record(model_cards={PREFIX: card}))
