"""Constants shared by Dynamo workers: runtime-data keys and worker mode enums."""

from __future__ import annotations

from enum import Enum

# Keys in `ModelRuntimeConfig.runtime_data` read by the Rust router.
ROUTER_HINT_RUNTIME_CAPABILITY_KEY = "router_hint"
ROUTER_HINT_WORKER_TYPE_RUNTIME_KEY = "router_hint_worker_type"
ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS_RUNTIME_KEY = "router_hint_source_control_endpoints"


class DisaggregationMode(Enum):
    """Disaggregation mode for LLM workers."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


class EmbeddingTransferMode(Enum):
    """Embedding transfer mode for LLM workers."""

    LOCAL = "local"
    NIXL_WRITE = "nixl-write"
    NIXL_READ = "nixl-read"
