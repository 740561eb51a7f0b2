"""Discovery records: instance ids, keys, the Endpoint/Model records and model cards, checked
against a hand-written golden document and against what upstream 1.6.1 was observed to write
(tests/unit/golden/discovery_upstream_1_6_1.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dynamo.common.token_budget import TokenBudget
from dynamo.runtime.discovery import AdapterCard, EndpointAddress, WorkerAdvertisement
from dynamo.runtime.discovery.file import encode_key
from dynamo.runtime.discovery.records import (
    discovery_metadata,
    endpoint_record,
    instance_key,
    kubernetes_instance_id,
    metadata_for,
    model_card,
    model_files,
    runtime_config,
    slugify,
    without_taints,
)
from dynamo.runtime.discovery.siphash import rust_str_hash, siphash13

pytestmark = pytest.mark.unit

GOLDEN = json.loads(
    (Path(__file__).parent / "golden" / "discovery_upstream_1_6_1.json").read_text()
)
ADDRESS = EndpointAddress("dynamo", "backend", "generate")


def compact(value: Any) -> str:
    """Byte-level form (key order included) as upstream writes records."""
    return json.dumps(value, separators=(",", ":"))


def advertisement(**changes: Any) -> WorkerAdvertisement:
    fields: dict[str, Any] = {
        "address": ADDRESS,
        "instance_id": 0x43710F49C0CFF,
        "served_model_name": "Tiny-Llama",
        "model": "/models/does-not-exist/tiny",
        "transport": {"http": "http://10.0.0.7:8000"},
        "runtime_config": {
            "context_length": 2048,
            "total_kv_blocks": 1000,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 2048,
            "data_parallel_size": 1,
            "data_parallel_start_rank": 0,
        },
    }
    fields.update(changes)
    return WorkerAdvertisement(**fields)


# --- instance ids -----------------------------------------------------------------------


def test_siphash13_reference_vector() -> None:
    # SipHash-1-3 of the empty message under key 00 01 .. 0f (the reference test vectors'
    # first entry, digest bytes dc c4 0f 05 58 01 ac ab read little-endian).
    key = bytes(range(16))
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    assert siphash13(b"", k0, k1) == 0xABAC0158050FC4DC


@pytest.mark.parametrize(
    ("name", "expected"), [("worker-0", 1186445869714687), ("main", 2156811118318955)]
)
def test_kubernetes_instance_id_matches_rust_default_hasher(name: str, expected: int) -> None:
    assert kubernetes_instance_id(name) == expected
    assert expected == rust_str_hash(name) & 0x001F_FFFF_FFFF_FFFF


def test_kubernetes_instance_id_observed_upstream() -> None:
    kube = GOLDEN["kubernetes"]
    instance_id = kubernetes_instance_id(kube["pod_name"])
    assert instance_id == kube["instance_id"]
    assert (
        instance_key(EndpointAddress("dynamo", "sample", "generate"), instance_id)
        == (kube["endpoint_key"])
    )


def test_siphash_covers_every_tail_length() -> None:
    # Each length 0..16 takes a different path through the tail handling; all must differ.
    digests = {siphash13(bytes(range(n))) for n in range(17)}
    assert len(digests) == 17
    assert all(0 <= d < 1 << 64 for d in digests)


# --- keys and slugs ---------------------------------------------------------------------


def test_instance_key_is_lower_case_hex_without_leading_zeros() -> None:
    assert instance_key(ADDRESS, 0x0ABC) == "dynamo/backend/generate/abc"
    assert instance_key(ADDRESS, 5270422560841039888) == "dynamo/backend/generate/49244d652b228010"


@pytest.mark.parametrize("field", ["namespace", "component", "endpoint"])
def test_instance_key_refuses_a_slash_in_a_segment(field: str) -> None:
    parts = {"namespace": "dynamo", "component": "backend", "endpoint": "generate", field: "a/b"}
    with pytest.raises(ValueError, match=f"endpoint {field} 'a/b' must be non-empty"):
        instance_key(EndpointAddress(**parts), 1)


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("My-LoRA_Adapter.v1", "my-lora_adapter_v1"),
        ("/tmp/oracle/model", "tmp_oracle_model"),
        ("Tiny-Base.v1", "tiny-base_v1"),
        ("__x", "x"),
        ("é-1", "-1"),
    ],
)
def test_slugify(name: str, slug: str) -> None:
    assert slugify(name) == slug


# --- golden records -----------------------------------------------------------------------


def test_golden_metadata_for_a_fixed_advertisement() -> None:
    adv = advertisement(
        runtime_config={
            **advertisement().runtime_config,
            "runtime_data": {"token_budget": TokenBudget(4096, True, False)},
            "taints": ["team=a", "gpu=h100", "team=a"],
        }
    )
    key = "dynamo/backend/generate/43710f49c0cff"
    expected_card = {
        "display_name": "Tiny-Llama",
        "slug": "tiny-llama",
        "source_path": "/models/does-not-exist/tiny",
        "context_length": 2048,
        "kv_cache_block_size": 16,
        "migration_limit": 0,
        "model_type": "Chat | Completions",
        "model_input": "Tokens",
        "worker_type": "aggregated",
        "needs": [],
        "runtime_config": {
            "context_length": 2048,
            "total_kv_blocks": 1000,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 2048,
            "tool_call_parser": None,
            "reasoning_parser": None,
            "tool_call_arguments_format": "json_string",
            "structural_tag_mode": "off",
            "structural_tag_scope": "auto",
            "structural_tag_schema": "auto",
            "exclude_tools_when_tool_choice_none": True,
            "data_parallel_start_rank": 0,
            "data_parallel_size": 1,
            "enable_local_indexer": False,
            "runtime_data": {
                "token_budget": {
                    "combined_limit": 4096,
                    "reject_prompt_overflow": True,
                    "reject_total_overflow": False,
                }
            },
            "enable_eagle": False,
            "taints": ["gpu=h100", "team=a"],
        },
        "media_decoder": None,
        "media_fetcher": None,
    }
    expected = {
        "endpoints": {
            key: {
                "type": "Endpoint",
                "component": "backend",
                "endpoint": "generate",
                "namespace": "dynamo",
                "instance_id": 1186445869714687,
                "transport": {"http": "http://10.0.0.7:8000"},
                "device_type": "cpu",
            }
        },
        "model_cards": {
            key: {
                "type": "Model",
                "namespace": "dynamo",
                "component": "backend",
                "endpoint": "generate",
                "instance_id": 1186445869714687,
                "card_json": expected_card,
            }
        },
        "event_channels": {},
        "event_sources": {},
    }
    assert compact(metadata_for(adv)) == compact(expected)


def _write_observed_model(folder: Path) -> None:
    for name, text in GOLDEN["model_files"].items():
        (folder / name).write_text(text, encoding="utf-8")


def _observed_advertisement(model_dir: Path) -> WorkerAdvertisement:
    given = GOLDEN["advertisement"]
    return WorkerAdvertisement(
        address=EndpointAddress(given["namespace"], given["component"], given["endpoint"]),
        instance_id=given["instance_id"],
        served_model_name=given["served_model_name"],
        model=str(model_dir),
        transport={"tcp": "127.0.0.1:1/x"},
        runtime_config=given["runtime_config"],
        adapters=(
            AdapterCard(given["adapter"]["lora_name"], given["adapter"]["lora_id"], "s3://b/a"),
        ),
    )


def test_cards_equal_what_upstream_wrote_for_the_same_model(tmp_path: Path) -> None:
    """Byte for byte, key order included: base card and LoRA card, with blake3 file entries."""
    _write_observed_model(tmp_path)
    adv = _observed_advertisement(tmp_path)
    cards = metadata_for(adv)["model_cards"]
    observed = {
        name.removeprefix("v1/mdc/"): json.loads(
            compact(record).replace("{model_dir}", str(tmp_path.resolve()))
        )
        for name, record in GOLDEN["file_records"].items()
    }
    assert {encode_key(key) for key in cards} == set(observed)
    for key, record in cards.items():
        assert compact(record) == compact(observed[encode_key(key)])


def test_endpoint_record_has_upstream_fields_in_upstream_order() -> None:
    observed = GOLDEN["endpoint_record"]
    adv = advertisement(
        address=EndpointAddress(observed["namespace"], observed["component"], observed["endpoint"]),
        instance_id=observed["instance_id"],
        transport=observed["transport"],
        device_type=observed["device_type"],
    )
    # request_plane_codec describes upstream's TCP request plane, which we do not serve yet.
    expected = {k: v for k, v in observed.items() if k != "request_plane_codec"}
    assert compact(endpoint_record(adv)) == compact(expected)


# --- LoRA cards and taints ------------------------------------------------------------


def test_lora_adapter_card() -> None:
    adv = advertisement(
        runtime_config={**advertisement().runtime_config, "max_gpu_lora_count": 4},
        adapters=(AdapterCard("My-LoRA_Adapter.v1", 77, "s3://bucket/a"),),
    )
    cards = discovery_metadata(adv)["model_cards"]
    key = "dynamo/backend/generate/43710f49c0cff/my-lora_adapter_v1"
    record = cards[key]
    assert record["model_suffix"] == "my-lora_adapter_v1"
    assert list(record)[-1] == "model_suffix"
    card = record["card_json"]
    assert card["display_name"] == "My-LoRA_Adapter.v1"
    assert card["slug"] == "my-lora_adapter_v1"
    assert card["source_path"] == adv.model
    assert card["lora"] == {"name": "My-LoRA_Adapter.v1", "max_gpu_lora_count": 4}
    assert card["user_data"] == {"lora_adapter": True, "lora_id": 77}
    assert list(card).index("lora") == list(card).index("needs") + 1
    assert "max_gpu_lora_count" not in card["runtime_config"]
    base = cards["dynamo/backend/generate/43710f49c0cff"]["card_json"]
    assert base["runtime_config"]["max_gpu_lora_count"] == 4
    assert "model_suffix" not in cards["dynamo/backend/generate/43710f49c0cff"]


def test_two_adapters_with_one_slug_are_refused() -> None:
    adv = advertisement(adapters=(AdapterCard("A.b", 1, "u"), AdapterCard("a_b", 2, "v")))
    with pytest.raises(ValueError, match="same slug as another served model"):
        discovery_metadata(adv)


def test_taints_are_sorted_unique_and_omitted_when_empty() -> None:
    assert "taints" not in runtime_config(advertisement())
    assert "taints" not in runtime_config(advertisement(runtime_config={"taints": set()}))
    tainted = runtime_config(advertisement(runtime_config={"taints": {"b", "a", "c"}}))
    assert tainted["taints"] == ["a", "b", "c"]
    assert list(tainted)[-1] == "taints"
    with pytest.raises(ValueError, match=r"runtime_config\.taints must be a collection"):
        runtime_config(advertisement(runtime_config={"taints": "gpu=h100"}))


def test_only_taints_differ_is_detectable() -> None:
    plain = discovery_metadata(advertisement())["model_cards"]
    tainted = discovery_metadata(
        advertisement(runtime_config={**advertisement().runtime_config, "taints": ["x"]})
    )["model_cards"]
    key = next(iter(plain))
    assert plain[key] != tainted[key]
    assert without_taints(plain[key]) == without_taints(tainted[key])
    longer = advertisement(runtime_config={**advertisement().runtime_config, "context_length": 9})
    assert without_taints(discovery_metadata(longer)["model_cards"][key]) != without_taints(
        plain[key]
    )


def test_runtime_config_defaults_and_extras() -> None:
    rc = runtime_config(advertisement(runtime_config={"tool_call_parser": "hermes", "custom": 1}))
    assert "context_length" not in rc
    assert rc["total_kv_blocks"] is None
    assert rc["tool_call_parser"] == "hermes"
    assert rc["enable_local_indexer"] is False
    assert "runtime_data" not in rc
    assert list(rc)[-1] == "custom"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"total_kv_blocks": -1}, "runtime_config.total_kv_blocks must be an unsigned 64-bit"),
        ({"max_num_seqs": True}, "runtime_config.max_num_seqs must be an unsigned 64-bit"),
        ({"runtime_data": [1]}, "runtime_config.runtime_data must be a mapping"),
        ({"runtime_data": {"k": object()}}, r"runtime_config.runtime_data\['k'\] is not JSON"),
    ],
)
def test_bad_runtime_config_names_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        runtime_config(advertisement(runtime_config=config))


def test_empty_served_name_is_refused() -> None:
    with pytest.raises(ValueError, match="served_model_name must be non-empty"):
        model_card(advertisement(served_model_name=""))


def test_model_files_for_a_folder_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"n_positions": 128}')
    files = model_files(str(tmp_path))
    assert set(files) == {"model_info", "architectural_max_context_length"}
    assert files["architectural_max_context_length"] == 128
    entry = files["model_info"]["hf_config_json"]
    assert entry["path"] == str((tmp_path / "config.json").resolve())
    assert entry["checksum"].startswith("blake3:")
    assert len(entry["checksum"]) == len("blake3:") + 64
    assert entry["size"] == len('{"n_positions": 128}')
    # Editing the file changes the entry (the cache is keyed by size and mtime).
    (tmp_path / "config.json").write_text('{"n_positions": 4096}')
    assert model_files(str(tmp_path))["architectural_max_context_length"] == 4096
    assert model_files(str(tmp_path / "missing")) == {}
    adv = advertisement(model=str(tmp_path), runtime_config={})
    card = model_card(adv, model_files(adv.model))
    assert card["context_length"] == 4096  # falls back to the architectural limit
