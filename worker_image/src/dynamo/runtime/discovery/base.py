"""The contract between the worker lifecycle and a discovery backend.

The lifecycle (dynamo.runtime.worker) builds a `WorkerAdvertisement` describing what this
process serves and hands it to a backend; the backend turns it into upstream Dynamo's
`DiscoveryMetadata` records (see records.py) and stores them where upstream components look:
a `DynamoWorkerMetadata` object (kubernetes), files under `$DYN_FILE_KV` (file), or memory
(mem). Backends are chosen by `DYN_DISCOVERY_BACKEND` (see `backend_from_env`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class EndpointAddress:
    """Where a served endpoint is: upstream's `{namespace}/{component}/{endpoint}` triple."""

    namespace: str
    component: str
    endpoint: str


@dataclass(frozen=True)
class AdapterCard:
    """A LoRA adapter loaded on this worker, published as its own model card."""

    lora_name: str
    lora_id: int
    source_uri: str


@dataclass(frozen=True)
class EventChannelAd:
    """One event-plane publisher of this worker: its topic, publisher id and ZMQ endpoint.

    `dp_rank` is set for KV-event publishers (one per data-parallel rank): discovery then also
    publishes an EventSource mapping the publisher to this worker and rank.
    """

    topic: str
    publisher_id: int
    endpoint: str
    dp_rank: int | None = None


@dataclass(frozen=True)
class WorkerAdvertisement:
    """Everything a backend needs to publish this worker.

    `transport` is upstream's Endpoint transport object (e.g. `{"tcp": "ip:port/path"}`) or,
    for our HTTP request plane, `{"http": "http://ip:port"}` (upstream's readers know only
    `tcp` and `nats_tcp`). `request_plane_codec` ("msgpack" or "json") is how the TCP request
    plane encodes bodies; None omits it (upstream's frontend then sends JSON).
    `event_channels` are the worker's event-plane publishers (kv-events, kv_metrics).
    `runtime_config` holds the model card's runtime_config fields (context_length,
    total_kv_blocks, max_num_seqs, max_num_batched_tokens, data_parallel_size,
    data_parallel_start_rank, runtime_data, taints, max_gpu_lora_count). `model_type`,
    `model_input`, `worker_type`, `needs` and `kv_cache_block_size` are the card fields of
    the same names (upstream's spellings, e.g. "Chat | Completions"; `needs` lists the sets
    of worker types that must also serve the model, e.g. `(("decode",),)` for a prefill
    worker). `card_file_base_url`
    (`http://host:port` of the system server) makes the cards name their files by URL
    instead of local path (see `dynamo.runtime.card_files`).
    """

    address: EndpointAddress
    instance_id: int
    served_model_name: str
    model: str
    transport: dict[str, Any]
    runtime_config: dict[str, Any] = field(default_factory=dict)
    adapters: tuple[AdapterCard, ...] = ()
    device_type: str = "cpu"
    model_type: str = "Chat | Completions"
    model_input: str = "Tokens"
    worker_type: str = "aggregated"
    needs: tuple[tuple[str, ...], ...] = ()
    kv_cache_block_size: int = 16
    request_plane_codec: str | None = None
    event_channels: tuple[EventChannelAd, ...] = ()
    card_file_base_url: str | None = None


class DiscoveryBackend(Protocol):
    """A place to publish a worker. Every method is idempotent."""

    async def register(self, advertisement: WorkerAdvertisement) -> None:
        """Publish the endpoint and its model cards (first time, at startup)."""

    async def update(self, advertisement: WorkerAdvertisement) -> None:
        """Re-publish after a change (adapter loaded/unloaded, taints changed)."""

    async def unregister(self) -> None:
        """Withdraw the endpoint so no new requests are routed here (first step of shutdown)."""

    async def close(self) -> None:
        """Stop background work (e.g. file liveness touches) and remove what remains."""

    def metadata(self) -> dict[str, Any] | None:
        """The current DiscoveryMetadata JSON (served at /metadata), or None when unpublished."""
