"""The seed's public API of `dynamo.common`, name for name, as literal data.

Facts copied from the seed API document (50 classes, 30 functions): the module each
name is imported from, whether it is a class or a function, the parameter names of the
constructor or function, and the parameter names of each public method the seed lists.

Parameter lists use `*` for the keyword-only marker and `*name` / `**name` for variadic
parameters; `self` and `cls` are left out. `params` is None where the seed documents no
constructor signature (enums, exceptions, TypedDicts, pydantic models, msgspec structs).
"""

from __future__ import annotations

from typing import NamedTuple


class SeedEntry(NamedTuple):
    """One documented name."""

    module: str
    name: str
    kind: str  # "class" or "function"
    params: tuple[str, ...] | None
    methods: dict[str, tuple[str, ...]]


SEED_API: tuple[SeedEntry, ...] = (
    SeedEntry(
        "dynamo.common.multimodal",
        "AbstractEmbeddingReceiver",
        "class",
        None,
        {"receive_embeddings": ("request",), "release_tensor": ("tensor_id",)},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "AbstractEmbeddingSender",
        "class",
        None,
        {"send_embeddings": ("embeddings", "stage_embeddings")},
    ),
    SeedEntry("dynamo.common.http", "AiohttpClient", "class", ("config",), {"close": ()}),
    SeedEntry(
        "dynamo.common.multimodal",
        "AsyncEncoderCache",
        "class",
        ("cache",),
        {"get": ("key",), "get_or_compute": ("key", "compute_fn")},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "AudioLoader",
        "class",
        ("http_timeout", "enable_frontend_decoding", "url_policy"),
        {"load_audio": ("audio_url",), "load_audio_batch": ("audio_mm_items",)},
    ),
    SeedEntry(
        "dynamo.common.backend",
        "BaseEngine",
        "class",
        None,
        {
            "from_args": ("argv",),
            "start": ("worker_id",),
            "abort": ("context",),
            "is_quiescent": (),
            "cleanup": (),
            "register_prometheus": ("metrics",),
            "component_metrics_dp_ranks": (),
            "attach_snapshot_publisher": ("publisher",),
            "health_check_payload": (),
            "supported_controls": (),
            "engine_control": ("control", "body"),
            "supported_updates": (),
            "engine_update": ("update", "body"),
            "on_endpoint_ready": ("endpoint",),
        },
    ),
    SeedEntry("dynamo.common.backend", "DiffusionEngine", "class", None, {}),
    SeedEntry("dynamo.common.constants", "DisaggregationMode", "class", None, {}),
    SeedEntry("dynamo.common.constants", "EmbeddingTransferMode", "class", None, {}),
    SeedEntry(
        "dynamo.common.backend",
        "EngineConfig",
        "class",
        ("model", "served_model_name", "runtime_data", "llm", "model_aliases"),
        {},
    ),
    SeedEntry(
        "dynamo.common.engine_monitor",
        "EngineHealthMonitorConfig",
        "class",
        ("interval", "check_timeout", "shutdown_timeout"),
        {"from_env": ("*", "interval", "check_timeout", "shutdown_timeout")},
    ),
    SeedEntry("dynamo.common.forward_pass_metrics", "ForwardPassMetrics", "class", None, {}),
    SeedEntry("dynamo.common.backend", "GenerateChunk", "class", None, {}),
    SeedEntry("dynamo.common.backend", "GenerateRequest", "class", None, {}),
    SeedEntry(
        "dynamo.common.http",
        "HttpClient",
        "class",
        ("config",),
        {"fetch_bytes": ("url", "timeout", "*", "policy"), "close": ()},
    ),
    SeedEntry("dynamo.common.http", "HttpConnectionError", "class", None, {}),
    SeedEntry("dynamo.common.http", "HttpError", "class", None, {}),
    SeedEntry("dynamo.common.http", "HttpStatusError", "class", ("status", "message", "url"), {}),
    SeedEntry("dynamo.common.http", "HttpTimeoutError", "class", None, {}),
    SeedEntry("dynamo.common.http", "HttpxClient", "class", ("config",), {"close": ()}),
    SeedEntry(
        "dynamo.common.multimodal",
        "ImageLoader",
        "class",
        ("cache_size", "http_timeout", "enable_frontend_decoding", "url_policy"),
        {
            "load_image": ("image_url",),
            "load_image_batch": ("image_mm_items", "*", "preserve_uuid_slots"),
        },
    ),
    SeedEntry(
        "dynamo.common.backend",
        "LLMEngine",
        "class",
        None,
        {"generate": ("request", "context"), "kv_event_sources": (), "logits_processor_spec": ()},
    ),
    SeedEntry(
        "dynamo.common.backend",
        "LlmRegistration",
        "class",
        (
            "context_length",
            "kv_cache_block_size",
            "total_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "data_parallel_size",
            "data_parallel_start_rank",
            "bootstrap_host",
            "bootstrap_port",
        ),
        {},
    ),
    SeedEntry("dynamo.common.lora", "LoRAInfo", "class", ("id", "path"), {}),
    SeedEntry(
        "dynamo.common.lora",
        "LoRAManager",
        "class",
        ("cache_path",),
        {
            "register_custom_source": ("scheme", "source"),
            "download_lora": ("lora_uri",),
            "is_cached": ("lora_uri",),
        },
    ),
    SeedEntry(
        "dynamo.common.lora",
        "LoRASourceProtocol",
        "class",
        None,
        {"download": ("lora_uri", "dest_path"), "exists": ("lora_uri",)},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "LocalEmbeddingReceiver",
        "class",
        (),
        {"receive_embeddings": ("request",), "release_tensor": ("tensor_id",)},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "LocalEmbeddingSender",
        "class",
        (),
        {
            "save_embeddings_to_file": ("embedding_key", "embeddings"),
            "send_embeddings": ("embeddings", "stage_embeddings"),
        },
    ),
    SeedEntry(
        "dynamo.common.metadata_upload",
        "MetadataUploader",
        "class",
        ("url",),
        {
            "from_settings": ("settings",),
            "from_backend_request": ("request",),
            "upload_choice": ("choice_index", "metadata"),
        },
    ),
    SeedEntry(
        "dynamo.common.memory",
        "MultimodalEmbeddingCacheManager",
        "class",
        ("capacity_bytes",),
        {"get": ("key",), "keys": (), "set": ("key", "entry"), "set_with_delta": ("key", "entry")},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "NixlReadEmbeddingReceiver",
        "class",
        ("embedding_hidden_size", "max_item_mm_token", "max_items"),
        {"receive_embeddings": ("request",), "release_tensor": ("tensor_id",)},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "NixlReadEmbeddingSender",
        "class",
        (),
        {"send_embeddings": ("embeddings", "stage_embeddings")},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "NixlWriteEmbeddingReceiver",
        "class",
        ("buffer_size",),
        {"receive_embeddings": ("request", "receive_timeout"), "release_tensor": ("tensor_id",)},
    ),
    SeedEntry(
        "dynamo.common.multimodal",
        "NixlWriteEmbeddingSender",
        "class",
        (),
        {"send_embeddings": ("embeddings", "stage_embeddings")},
    ),
    SeedEntry("dynamo.common.protocols", "NvCreateVideoRequest", "class", None, {}),
    SeedEntry("dynamo.common.protocols", "NvVideosResponse", "class", None, {}),
    SeedEntry(
        "dynamo.common.lora", "OnceLock", "class", (), {"get_or_init": ("initializer",), "get": ()}
    ),
    SeedEntry("dynamo.common.forward_pass_metrics", "QueuedRequestMetrics", "class", None, {}),
    SeedEntry("dynamo.common.rl", "RLAdminValidationError", "class", None, {}),
    SeedEntry(
        "dynamo.common.rl",
        "RLRouteRegistry",
        "class",
        ("runtime", "*", "logger_"),
        {
            "add_route": ("name", "handler"),
            "add_routes": ("routes",),
            "describe": (),
            "dispatch": ("request",),
            "dispatch_stream": ("request",),
        },
    ),
    SeedEntry(
        "dynamo.common.backend", "RawEngine", "class", None, {"generate": ("request", "context")}
    ),
    SeedEntry("dynamo.common.forward_pass_metrics", "ScheduledRequestMetrics", "class", None, {}),
    SeedEntry(
        "dynamo.common.token_budget",
        "TokenBudget",
        "class",
        ("combined_limit", "reject_prompt_overflow", "reject_total_overflow"),
        {},
    ),
    SeedEntry("dynamo.common.multimodal", "TransferRequest", "class", None, {}),
    SeedEntry(
        "dynamo.common.forward_pass_metrics", "UnsupportedFpmVersionError", "class", None, {}
    ),
    SeedEntry("dynamo.common.protocols", "VideoData", "class", None, {}),
    SeedEntry(
        "dynamo.common.multimodal",
        "VideoLoader",
        "class",
        ("http_timeout", "num_frames", "enable_frontend_decoding", "url_policy"),
        {"load_video": ("video_url",), "load_video_batch": ("video_mm_items",)},
    ),
    SeedEntry(
        "dynamo.common.forward_pass_metrics",
        "WelfordAccumulator",
        "class",
        (),
        {"add": ("v",), "variance": ()},
    ),
    SeedEntry("dynamo.common.backend", "Worker", "class", ("engine", "config"), {"run": ()}),
    SeedEntry(
        "dynamo.common.backend",
        "WorkerConfig",
        "class",
        (
            "namespace",
            "component",
            "endpoint",
            "model_name",
            "served_model_name",
            "model_input",
            "endpoint_types",
            "discovery_backend",
            "request_plane",
            "event_plane",
            "use_kv_events",
            "custom_jinja_template",
            "tool_call_parser",
            "reasoning_parser",
            "exclude_tools_when_tool_choice_none",
            "enable_local_indexer",
            "enable_kv_routing",
            "metrics_labels",
            "disaggregation_mode",
            "health_check_payload",
            "structural_tag_mode",
            "structural_tag_scope",
            "structural_tag_schema",
            "route_to_encoder",
            "media_decoder",
            "media_fetcher",
            "kv_state_endpoint",
            "default_thinking_mode",
        ),
        {
            "from_runtime_config": (
                "runtime_cfg",
                "model_name",
                "served_model_name",
                "model_input",
                "**overrides",
            )
        },
    ),
    SeedEntry("dynamo.common.config_dump", "add_config_dump_args", "function", ("parser",), {}),
    SeedEntry("dynamo.common.http", "close_http_client", "function", (), {}),
    SeedEntry("dynamo.common.forward_pass_metrics", "decode", "function", ("data",), {}),
    SeedEntry(
        "dynamo.common.config_dump", "dump_config", "function", ("dump_config_to", "config"), {}
    ),
    SeedEntry("dynamo.common.forward_pass_metrics", "encode", "function", ("metrics",), {}),
    SeedEntry("dynamo.common.rl", "env_bool", "function", ("name", "default"), {}),
    SeedEntry(
        "dynamo.common.http", "fetch_bytes", "function", ("url", "timeout", "*", "policy"), {}
    ),
    SeedEntry(
        "dynamo.common.model_fetch",
        "fetch_model",
        "function",
        ("remote_name", "ignore_weights"),
        {},
    ),
    SeedEntry(
        "dynamo.common.model_fetch",
        "fetch_model_in_subprocess",
        "function",
        ("remote_name", "ignore_weights"),
        {},
    ),
    SeedEntry(
        "dynamo.common.rl", "first_endpoint_response", "function", ("endpoint_handler", "body"), {}
    ),
    SeedEntry(
        "dynamo.common.config_dump", "get_config_dump", "function", ("config", "extra_info"), {}
    ),
    SeedEntry("dynamo.common.http", "get_default_client", "function", (), {}),
    SeedEntry(
        "dynamo.common.config_dump",
        "get_environment_vars",
        "function",
        ("prefixes", "include_sensitive", "additional_vars"),
        {},
    ),
    SeedEntry("dynamo.common.storage", "get_fs", "function", ("fs_url",), {}),
    SeedEntry("dynamo.common.config_dump", "get_gpu_info", "function", (), {}),
    SeedEntry("dynamo.common.lora", "get_lora_manager", "function", (), {}),
    SeedEntry(
        "dynamo.common.storage", "get_media_url", "function", ("fs", "storage_path", "base_url"), {}
    ),
    SeedEntry(
        "dynamo.common.native_offloading",
        "get_native_offloading_capacity_tokens",
        "function",
        ("runtime_data",),
        {},
    ),
    SeedEntry("dynamo.common.config_dump", "get_runtime_info", "function", (), {}),
    SeedEntry("dynamo.common.config_dump", "get_system_info", "function", (), {}),
    SeedEntry("dynamo.common.recv_forward_pass_metrics", "main", "function", (), {}),
    SeedEntry(
        "dynamo.common.native_offloading",
        "native_offloading_capacity",
        "function",
        ("total_tokens",),
        {},
    ),
    SeedEntry(
        "dynamo.common.token_budget",
        "publish_token_budget",
        "function",
        ("runtime_config", "token_budget"),
        {},
    ),
    SeedEntry("dynamo.common.config_dump", "register_encoder", "function", ("type_class",), {}),
    SeedEntry(
        "dynamo.common.model_taints",
        "register_model_taint_route",
        "function",
        ("runtime", "endpoint"),
        {},
    ),
    SeedEntry(
        "dynamo.common.rl",
        "register_rl_routes",
        "function",
        ("runtime", "registry", "routes", "*", "enable_dispatch"),
        {},
    ),
    SeedEntry("dynamo.common.rl", "require_lora_load_request", "function", ("request",), {}),
    SeedEntry("dynamo.common.rl", "require_lora_unload_request", "function", ("request",), {}),
    SeedEntry("dynamo.common.recv_forward_pass_metrics", "run", "function", ("args",), {}),
    SeedEntry(
        "dynamo.common.storage",
        "upload_to_fs",
        "function",
        ("fs", "storage_path", "data", "base_url"),
        {},
    ),
)
