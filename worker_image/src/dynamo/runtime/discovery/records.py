"""Upstream Dynamo's discovery records, built from a `WorkerAdvertisement`.

Upstream components (the Rust frontend and routers of ai-dynamo 1.6.1) find workers through
`DiscoveryMetadata`: four maps, `endpoints`, `model_cards`, `event_channels` and
`event_sources`, keyed by logical keys such as `dynamo/backend/generate/43710f49c0cff`
(namespace/component/endpoint/instance id in lower-case hex). Each value is a tagged record:

* `Endpoint`: where the instance serves requests (`transport`), keyed in `v1/instances`.
* `Model`: the model deployment card (`card_json`) the frontend reads to list and serve a
  model, keyed in `v1/mdc`; a LoRA adapter gets its own card under `<key>/<adapter slug>`
  with `model_suffix` set to that slug. Its files are named by local path, or by URL on the
  system server when the advertisement says so (`card_files`).

The field names, their order and the defaults below follow what upstream's 1.6.1 worker was
observed to write (file and Kubernetes backends alike). Everything here is pure except
`model_files`, which reads (and caches) the model directory's metadata files.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from blake3 import blake3

from dynamo.runtime.card_files import CardFileKey, allow_list, with_urls
from dynamo.runtime.discovery.base import (
    AdapterCard,
    EndpointAddress,
    EventChannelAd,
    WorkerAdvertisement,
)
from dynamo.runtime.discovery.siphash import rust_str_hash

# Kubernetes instance ids must survive a JSON round trip through JavaScript-style readers.
JSON_SAFE_MASK = 0x001F_FFFF_FFFF_FFFF

ENDPOINTS, MODEL_CARDS, EVENT_CHANNELS, EVENT_SOURCES = (
    "endpoints",
    "model_cards",
    "event_channels",
    "event_sources",
)

# runtime_config fields upstream always writes, in its order, with its defaults. Fields the
# advertisement sets replace these; others it sets are appended. `enable_local_indexer` is
# upstream's `true` only for workers that serve the KV-recovery endpoint; we do not, so our
# default is false (a frontend would otherwise wait on an endpoint that never answers).
_RUNTIME_CONFIG_HEAD: tuple[tuple[str, Any], ...] = (
    ("total_kv_blocks", None),
    ("max_num_seqs", None),
    ("max_num_batched_tokens", None),
    ("tool_call_parser", None),
    ("reasoning_parser", None),
    ("tool_call_arguments_format", "json_string"),
    ("structural_tag_mode", "off"),
    ("structural_tag_scope", "auto"),
    ("structural_tag_schema", "auto"),
    ("exclude_tools_when_tool_choice_none", True),
    ("data_parallel_start_rank", 0),
    ("data_parallel_size", 1),
    ("enable_local_indexer", False),
)
# Written after `runtime_data`, in this order (upstream: enable_eagle, taints, lora count).
_RUNTIME_CONFIG_TAIL = ("enable_eagle", "taints", "max_gpu_lora_count")
_U64_FIELDS = (
    "context_length",
    "total_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "data_parallel_start_rank",
    "data_parallel_size",
    "max_gpu_lora_count",
)

# The model directory's files a card points at: (file name, card field, wrapper key).
_CARD_FILES = (
    ("config.json", "model_info", "hf_config_json"),
    ("tokenizer.json", "tokenizer", "hf_tokenizer_json"),
    ("tokenizer_config.json", "prompt_formatter", "hf_tokenizer_config_json"),
    ("generation_config.json", "gen_config", "hf_generation_config_json"),
)
_CHAT_TEMPLATES = (
    ("chat_template.jinja", "hf_chat_template"),
    ("chat_template.json", "hf_chat_template_json"),
)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def slugify(name: str) -> str:
    """Upstream's model slug: lower-case; every character outside [a-z0-9_-] becomes `_`;
    leading underscores dropped. `My-LoRA_Adapter.v1` -> `my-lora_adapter_v1`."""
    lowered = name.lower()
    replaced = "".join(c if (c.isascii() and (c.isalnum() or c in "_-")) else "_" for c in lowered)
    return replaced.lstrip("_")


def kubernetes_instance_id(cr_name: str) -> int:
    """The instance id upstream derives from a DynamoWorkerMetadata name (the pod name):
    Rust's DefaultHasher (SipHash-1-3, zero keys) of the name, masked to 53 bits."""
    return rust_str_hash(cr_name) & JSON_SAFE_MASK


def instance_key(address: EndpointAddress, instance_id: int) -> str:
    """`{namespace}/{component}/{endpoint}/{instance id as lower-case hex}`."""
    for field_name in ("namespace", "component", "endpoint"):
        value = getattr(address, field_name)
        if not value or "/" in value:
            raise ValueError(
                f"endpoint {field_name} {value!r} must be non-empty and contain no '/':"
                " it is one segment of upstream's discovery keys"
            )
    return f"{address.namespace}/{address.component}/{address.endpoint}/{instance_id:x}"


def adapter_key(address: EndpointAddress, instance_id: int, lora_name: str) -> str:
    """The model-card key of a LoRA adapter: the instance key plus `/<adapter slug>`."""
    return f"{instance_key(address, instance_id)}/{slugify(lora_name)}"


def endpoint_record(adv: WorkerAdvertisement) -> dict[str, Any]:
    """The `Endpoint` record (upstream `v1/instances`)."""
    record: dict[str, Any] = {
        "type": "Endpoint",
        "component": adv.address.component,
        "endpoint": adv.address.endpoint,
        "namespace": adv.address.namespace,
        "instance_id": _u64("instance_id", adv.instance_id),
        "transport": copy.deepcopy(adv.transport),
        "device_type": adv.device_type,
    }
    if adv.request_plane_codec is not None:
        record["request_plane_codec"] = adv.request_plane_codec
    return record


def runtime_config(adv: WorkerAdvertisement, *, base: bool = True) -> dict[str, Any]:
    """The card's `runtime_config` (upstream `ModelRuntimeConfig`) in upstream's field order.

    `context_length` is omitted when unknown, `runtime_data` and `taints` when empty;
    `max_gpu_lora_count` belongs to the base card only (adapters carry it in `lora`).
    """
    given = dict(adv.runtime_config)
    for name in _U64_FIELDS:
        if given.get(name) is not None:
            given[name] = _u64(f"runtime_config.{name}", given[name])
    out: dict[str, Any] = {}
    if given.get("context_length") is not None:
        out["context_length"] = given["context_length"]
    for name, default in _RUNTIME_CONFIG_HEAD:
        out[name] = given.get(name, default)
    runtime_data = _runtime_data(given.get("runtime_data"))
    if runtime_data:
        out["runtime_data"] = runtime_data
    out["enable_eagle"] = bool(given.get("enable_eagle", False))
    taints = _taints(given.get("taints"))
    if taints:
        out["taints"] = taints
    if base and given.get("max_gpu_lora_count") is not None:
        out["max_gpu_lora_count"] = given["max_gpu_lora_count"]
    known = {"context_length", "runtime_data", *(n for n, _ in _RUNTIME_CONFIG_HEAD)}
    for name, value in given.items():
        if name not in known and name not in _RUNTIME_CONFIG_TAIL:
            out[name] = copy.deepcopy(value)
    return out


def model_card(
    adv: WorkerAdvertisement,
    files: Mapping[str, Any] | None = None,
    adapter: AdapterCard | None = None,
) -> dict[str, Any]:
    """The model deployment card (`card_json`) of the base model, or of `adapter`.

    `files` is `model_files(adv.model)`: the card's file entries and the architectural
    context length; without it the card names no files (a text-only reader still lists it).
    """
    files = files or {}
    name = adapter.lora_name if adapter else adv.served_model_name
    if not name:
        raise ValueError("served_model_name must be non-empty: it is the model id clients use")
    rc = runtime_config(adv, base=adapter is None)
    card: dict[str, Any] = {
        "display_name": name,
        "slug": slugify(name),
        "source_path": adv.model,
    }
    for field_name in ("model_info", "tokenizer", "prompt_formatter", "chat_template_file"):
        if field_name in files:
            card[field_name] = copy.deepcopy(files[field_name])
    if "gen_config" in files:
        card["gen_config"] = copy.deepcopy(files["gen_config"])
    architectural = files.get("architectural_max_context_length")
    if architectural is not None:
        card["architectural_max_context_length"] = architectural
    context_length = rc.get("context_length", architectural)
    if context_length is not None:
        card["context_length"] = context_length
    card["kv_cache_block_size"] = _u64("kv_cache_block_size", adv.kv_cache_block_size)
    card["migration_limit"] = 0
    card["model_type"] = adv.model_type
    card["model_input"] = adv.model_input
    card["worker_type"] = adv.worker_type
    card["needs"] = [list(group) for group in adv.needs]
    if adapter is not None:
        lora: dict[str, Any] = {"name": adapter.lora_name}
        slots = adv.runtime_config.get("max_gpu_lora_count")
        if slots is not None:
            lora["max_gpu_lora_count"] = _u64("runtime_config.max_gpu_lora_count", slots)
        card["lora"] = lora
        # Upstream's engines mark adapter cards this way; readers treat user_data as opaque.
        card["user_data"] = {"lora_adapter": True, "lora_id": adapter.lora_id}
    card["runtime_config"] = rc
    card["media_decoder"] = None
    card["media_fetcher"] = None
    return card


def model_record(
    adv: WorkerAdvertisement, card: dict[str, Any], adapter: AdapterCard | None = None
) -> dict[str, Any]:
    """The `Model` record (upstream `v1/mdc`) wrapping `card`."""
    record: dict[str, Any] = {
        "type": "Model",
        "namespace": adv.address.namespace,
        "component": adv.address.component,
        "endpoint": adv.address.endpoint,
        "instance_id": _u64("instance_id", adv.instance_id),
        "card_json": card,
    }
    if adapter is not None:
        record["model_suffix"] = slugify(adapter.lora_name)
    return record


def discovery_metadata(
    adv: WorkerAdvertisement, files: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Upstream's `DiscoveryMetadata` for this worker: its endpoint and one card per model
    (the base, then each adapter), and its event channels (with a source per KV-events one).
    The cards name their files by URL under `adv.card_file_base_url` when it is set."""
    key = instance_key(adv.address, adv.instance_id)
    cards: dict[str, Any] = {key: model_record(adv, model_card(adv, files))}
    for adapter in adv.adapters:
        adapter_record = model_record(adv, model_card(adv, files, adapter), adapter)
        akey = adapter_key(adv.address, adv.instance_id, adapter.lora_name)
        if akey in cards:
            raise ValueError(
                f"LoRA adapter {adapter.lora_name!r} has the same slug as another served model"
                f" ({slugify(adapter.lora_name)!r}); rename one of them"
            )
        cards[akey] = adapter_record
    channels: dict[str, Any] = {}
    sources: dict[str, Any] = {}
    for channel in adv.event_channels:
        ekey = event_key(adv.address, channel.topic, channel.publisher_id)
        channels[ekey] = event_channel_record(adv, channel)
        if channel.dp_rank is not None:
            sources[ekey] = event_source_record(adv, channel)
    metadata = {
        ENDPOINTS: {key: endpoint_record(adv)},
        MODEL_CARDS: cards,
        EVENT_CHANNELS: channels,
        EVENT_SOURCES: sources,
    }
    if adv.card_file_base_url:
        return with_urls(metadata, adv.card_file_base_url)
    return metadata


def encode_event_segment(segment: str) -> str:
    """One segment of an event key: `[A-Za-z0-9_-]` kept, every other byte `%XX`."""
    return "".join(
        chr(byte)
        if chr(byte).isascii() and (chr(byte).isalnum() or chr(byte) in "_-")
        else f"%{byte:02X}"
        for byte in segment.encode("utf-8")
    )


def event_key(address: EndpointAddress, topic: str, publisher_id: int) -> str:
    """The key of an endpoint-scoped event channel or source:
    `namespace/<ns>/component/<comp>/endpoint/<ep>/topic/<topic>/<publisher id hex>`."""
    parts = (
        ("namespace", address.namespace),
        ("component", address.component),
        ("endpoint", address.endpoint),
        ("topic", topic),
    )
    head = "/".join(f"{name}/{encode_event_segment(value)}" for name, value in parts)
    return f"{head}/{publisher_id:x}"


def _endpoint_scope(address: EndpointAddress) -> dict[str, Any]:
    return {
        "namespace": address.namespace,
        "component": address.component,
        "name": address.endpoint,
    }


def event_channel_record(adv: WorkerAdvertisement, channel: EventChannelAd) -> dict[str, Any]:
    """An `EventChannel` record: where subscribers connect for one topic's messages."""
    return {
        "type": "EventChannel",
        "scope": {"kind": "endpoint", "endpoint": _endpoint_scope(adv.address)},
        "topic": channel.topic,
        "instance_id": _u64("publisher_id", channel.publisher_id),
        "transport": {"kind": "Zmq", "config": {"endpoint": channel.endpoint}},
    }


def event_source_record(adv: WorkerAdvertisement, channel: EventChannelAd) -> dict[str, Any]:
    """An `EventSource` record: maps a KV-events publisher to this worker and rank (without
    it upstream's router ignores the publisher). No recovery endpoint: live events only."""
    scope = _endpoint_scope(adv.address)
    publisher_id = _u64("publisher_id", channel.publisher_id)
    return {
        "type": "EventSource",
        "scope": {"kind": "endpoint", "endpoint": scope},
        "topic": channel.topic,
        "publisher_id": publisher_id,
        "metadata": {
            "kv_state_endpoint": scope,
            "worker": {
                "worker_id": _u64("instance_id", adv.instance_id),
                "dp_rank": channel.dp_rank,
            },
            "publisher_id": publisher_id,
        },
    }


def metadata_for(adv: WorkerAdvertisement) -> dict[str, Any]:
    """`discovery_metadata` with the model directory's files when `adv.model` is one."""
    return discovery_metadata(adv, model_files(adv.model))


async def build_metadata(adv: WorkerAdvertisement) -> dict[str, Any]:
    """`metadata_for` off the event loop (hashing a large tokenizer file takes a while)."""
    return await asyncio.to_thread(metadata_for, adv)


def card_file_paths(adv: WorkerAdvertisement) -> dict[CardFileKey, Path]:
    """The system server's allow-list for `adv`: the local file behind each file its cards
    name, by the key of the URL it is (or would be) published under."""
    local = dataclasses.replace(adv, card_file_base_url=None)
    return allow_list(metadata_for(local))


def without_taints(card_record: Mapping[str, Any]) -> dict[str, Any]:
    """A Model record minus `card_json.runtime_config.taints`: two records that compare equal
    this way differ at most in taints, the one card field upstream lets change in place."""
    stripped = copy.deepcopy(dict(card_record))
    stripped.get("card_json", {}).get("runtime_config", {}).pop("taints", None)
    return stripped


def model_files(model: str) -> dict[str, Any]:
    """The card entries for a local model directory (`{}` for anything else).

    Each entry is upstream's CheckedFile, `{"path": <absolute path>, "checksum":
    "blake3:<hex>", "size": <bytes>}`: a frontend on the same filesystem reads and verifies the
    file (`card_files.with_urls` turns the paths into system-server URLs for the others).
    Cached per (file, size, mtime), so re-publishing after an adapter change is cheap.
    """
    root = Path(model)
    if not root.is_dir():
        return {}
    root = root.resolve()
    out: dict[str, Any] = {}
    for file_name, field_name, kind in _CARD_FILES:
        entry = _checked_file(root / file_name)
        if entry is not None:
            out[field_name] = {kind: entry}
    for file_name, kind in _CHAT_TEMPLATES:
        entry = _checked_file(root / file_name)
        if entry is not None:
            out["chat_template_file"] = {kind: {"is_custom": False, "file": entry}}
            break
    config = root / "config.json"
    if config.is_file():
        out.update(_architectural_context(str(config), *_stamp(config)))
    return out


def _checked_file(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    size, mtime = _stamp(path)
    return dict(_hash_file(str(path), size, mtime))


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=256)
def _hash_file(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, Any], ...]:
    hasher = blake3()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(chunk)
    return (("path", path), ("checksum", f"blake3:{hasher.hexdigest()}"), ("size", size))


@lru_cache(maxsize=64)
def _architectural_context(path: str, size: int, mtime_ns: int) -> dict[str, int]:
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return {"architectural_max_context_length": value}
    return {}


def _u64(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ValueError(f"{name} must be an unsigned 64-bit integer, got {value!r}")
    return value


def _runtime_data(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"runtime_config.runtime_data must be a mapping of key to JSON value, got {value!r}"
        )
    out: dict[str, Any] = {}
    for key, item in value.items():
        # A frozen dataclass such as TokenBudget publishes as its fields, like upstream's JSON.
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            item = dataclasses.asdict(item)
        try:
            out[str(key)] = json.loads(json.dumps(item))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"runtime_config.runtime_data[{key!r}] is not JSON: {exc}") from exc
    return out


def _taints(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"runtime_config.taints must be a collection of strings, got {value!r}")
    return sorted(set(value))
