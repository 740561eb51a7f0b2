"""Build this worker's `WorkerAdvertisement` (what discovery publishes) from its configs.

Upstream's rules (§8.4 step 7-8 of the behaviour notes): the served name is
`WorkerConfig.served_model_name` > `EngineConfig.served_model_name` > `EngineConfig.model`;
the model type comes from `endpoint_types` (a `Prefill` marker for prefill workers, nothing
for encode workers); `runtime_config` carries the engine's registration, the parsers, the
data-parallel layout, `runtime_data` (with the token budget) and the taints.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from dynamo.common.backend.engine import EngineConfig
from dynamo.common.backend.worker_config import WorkerConfig
from dynamo.common.constants import DisaggregationMode
from dynamo.runtime.discovery.base import (
    AdapterCard,
    EndpointAddress,
    EventChannelAd,
    WorkerAdvertisement,
)

# Upstream's ModelType bit names, in bit order, and the endpoint_types words for each.
_MODEL_TYPE_WORDS = (
    ("Chat", ("chat",)),
    ("Completions", ("completions",)),
    ("Embedding", ("embedding", "embeddings")),
    ("TensorBased", ("tensor",)),
    ("Images", ("images", "image")),
    ("Audios", ("audios", "audio")),
    ("Videos", ("videos", "video")),
)
_WORKER_TYPES = {
    DisaggregationMode.AGGREGATED: "aggregated",
    DisaggregationMode.PREFILL: "prefill",
    DisaggregationMode.DECODE: "decode",
    DisaggregationMode.ENCODE: "encode",
}
# The worker types each role cannot serve without (the card's `needs`): upstream's frontend
# serves a disaggregated model only once both halves of the pair are registered.
_NEEDS: dict[DisaggregationMode, tuple[tuple[str, ...], ...]] = {
    DisaggregationMode.PREFILL: (("decode",),),
    DisaggregationMode.DECODE: (("prefill",),),
}


def served_name(config: WorkerConfig, engine_config: EngineConfig) -> str:
    """The model id clients use."""
    return config.served_model_name or engine_config.served_model_name or engine_config.model


def parse_endpoint_types(endpoint_types: str) -> list[str]:
    """Upstream model-type names for a comma-separated `endpoint_types` (trimmed, any case);
    ValueError for an unknown word or an empty list."""
    words = [word.strip().lower() for word in endpoint_types.split(",") if word.strip()]
    if not words:
        raise ValueError("endpoint_types is empty; use e.g. 'chat,completions'")
    known = {word: name for name, spellings in _MODEL_TYPE_WORDS for word in spellings}
    unknown = [word for word in words if word not in known]
    if unknown:
        raise ValueError(
            f"endpoint_types has unknown type(s) {unknown}; use a comma-separated list of "
            f"{', '.join(sorted(known))}"
        )
    chosen = {known[word] for word in words}
    return [name for name, _ in _MODEL_TYPE_WORDS if name in chosen]


def model_type(config: WorkerConfig) -> str:
    """The card's `model_type` text, e.g. "Chat | Completions"."""
    if config.disaggregation_mode is DisaggregationMode.PREFILL:
        return "Prefill"
    if config.disaggregation_mode is DisaggregationMode.ENCODE:
        return ""
    return " | ".join(parse_endpoint_types(config.endpoint_types))


def runtime_config(
    config: WorkerConfig,
    engine_config: EngineConfig,
    *,
    runtime_data: dict[str, Any],
    taints: list[str],
    max_loras: int | None,
) -> dict[str, Any]:
    """The card's `runtime_config`."""
    llm = engine_config.llm
    out: dict[str, Any] = {}
    if llm is not None:
        for name in ("context_length", "total_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(llm, name)
            if value is not None:
                out[name] = value
        out["data_parallel_size"] = llm.data_parallel_size or 1
        out["data_parallel_start_rank"] = llm.data_parallel_start_rank or 0
        if llm.bootstrap_host and llm.bootstrap_port:
            out["disaggregated_endpoint"] = {
                "bootstrap_host": llm.bootstrap_host,
                "bootstrap_port": llm.bootstrap_port,
            }
    out["tool_call_parser"] = config.tool_call_parser
    out["reasoning_parser"] = config.reasoning_parser
    out["structural_tag_mode"] = config.structural_tag_mode
    out["structural_tag_scope"] = config.structural_tag_scope
    out["structural_tag_schema"] = config.structural_tag_schema
    out["exclude_tools_when_tool_choice_none"] = config.exclude_tools_when_tool_choice_none
    data = dict(runtime_data)
    if config.default_thinking_mode is not None:
        data["default_thinking_mode"] = config.default_thinking_mode
    out["runtime_data"] = data
    out["taints"] = sorted(set(taints))
    if max_loras is not None:
        out["max_gpu_lora_count"] = max_loras
    return out


def advertise_host(bound_host: str, environ: Any = os.environ) -> str:
    """The address peers reach the request plane at: the bound host unless it is a wildcard,
    else `POD_IP`, else this host's name resolved, else loopback."""
    if bound_host not in ("", "0.0.0.0", "::"):
        return bound_host
    pod_ip = environ.get("POD_IP")
    if pod_ip:
        return str(pod_ip)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def build_advertisement(
    config: WorkerConfig,
    engine_config: EngineConfig,
    *,
    instance_id: int,
    http_url: str,
    runtime_data: dict[str, Any],
    taints: list[str],
    adapters: dict[str, tuple[int, str]],
    max_loras: int | None = None,
    tcp_address: str | None = None,
    event_channels: tuple[EventChannelAd, ...] = (),
) -> WorkerAdvertisement:
    """Everything discovery publishes; `adapters` maps name -> (lora id, source uri).

    With `tcp_address` (`ip:port/path` of the TCP request plane) the Endpoint record
    advertises that, msgpack-encoded, so upstream's frontend routes here; else our HTTP URL.
    """
    llm = engine_config.llm
    transport = {"tcp": tcp_address} if tcp_address else {"http": http_url}
    return WorkerAdvertisement(
        address=EndpointAddress(config.namespace, config.component, config.endpoint),
        instance_id=instance_id,
        served_model_name=served_name(config, engine_config),
        model=engine_config.model,
        transport=transport,
        request_plane_codec="msgpack" if tcp_address else None,
        event_channels=event_channels,
        runtime_config=runtime_config(
            config, engine_config, runtime_data=runtime_data, taints=taints, max_loras=max_loras
        ),
        adapters=tuple(
            AdapterCard(lora_name=name, lora_id=lora_id, source_uri=uri)
            for name, (lora_id, uri) in sorted(adapters.items())
        ),
        model_type=model_type(config),
        model_input=config.model_input.name,
        worker_type=_WORKER_TYPES[config.disaggregation_mode],
        needs=_NEEDS.get(config.disaggregation_mode, ()),
        kv_cache_block_size=(llm.kv_cache_block_size if llm and llm.kv_cache_block_size else 16),
    )
