"""`WorkerConfig`: how a worker registers and serves one engine, beside the engine contract.

An engine's `from_args` returns it with the engine; the worker runtime reads it to validate,
register and serve the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dynamo.common.backend.health_check import parse_health_check_payload_cli
from dynamo.common.backend.model_input import ModelInput
from dynamo.common.constants import DisaggregationMode

# Frontend-side media decoding/fetching settings, provided by the runtime bindings.
MediaDecoder = Any
MediaFetcher = Any

# Attributes every runtime config must have; the rest fall back to defaults.
_REQUIRED_RUNTIME_FIELDS = ("namespace", "discovery_backend", "request_plane", "event_plane")


def coerce_disaggregation_mode(value: object) -> DisaggregationMode:
    """Map a config value to `DisaggregationMode`.

    None means aggregated. Another enum (e.g. a backend's own copy) maps by member name;
    anything else raises TypeError so a typo cannot silently become aggregated.
    """
    if value is None:
        return DisaggregationMode.AGGREGATED
    if isinstance(value, DisaggregationMode):
        return value
    if isinstance(value, Enum) and value.name in DisaggregationMode.__members__:
        return DisaggregationMode[value.name]
    raise TypeError(
        f"disaggregation_mode is {type(value).__name__}({value!r}); expected "
        "dynamo.common.constants.DisaggregationMode (or an enum with the same member names)"
    )


@dataclass
class WorkerConfig:
    """Registration and serving settings for one engine (field order is part of the API)."""

    namespace: str
    component: str = "backend"
    endpoint: str = "generate"
    model_name: str = ""
    served_model_name: str | None = None
    model_input: ModelInput = field(default_factory=lambda: ModelInput.Tokens)
    endpoint_types: str = "chat,completions"
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    event_plane: str | None = None
    # Deprecated: the event plane is chosen automatically; kept for source compatibility.
    use_kv_events: bool = False
    custom_jinja_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = True
    enable_local_indexer: bool = True
    # Operator kill switch for KV-aware routing publishers (KV events and load snapshots).
    enable_kv_routing: bool = True
    metrics_labels: list[tuple[str, str]] = field(default_factory=list)
    disaggregation_mode: DisaggregationMode = DisaggregationMode.AGGREGATED
    # Operator override of the engine's canary payload.
    health_check_payload: dict[str, Any] | None = None
    structural_tag_mode: str = "off"
    structural_tag_scope: str = "auto"
    structural_tag_schema: str = "auto"
    route_to_encoder: bool = False
    media_decoder: MediaDecoder | None = None
    media_fetcher: MediaFetcher | None = None
    kv_state_endpoint: str | None = None
    default_thinking_mode: str | None = None

    @classmethod
    def from_runtime_config(
        cls,
        runtime_cfg: Any,
        model_name: str,
        served_model_name: str | None = None,
        model_input: ModelInput | None = None,
        **overrides: Any,
    ) -> WorkerConfig:
        """Build from any object that carries the Dynamo runtime-config fields.

        `namespace`, `discovery_backend`, `request_plane` and `event_plane` are required;
        other fields default when absent. `overrides` win over everything.
        """
        missing = [name for name in _REQUIRED_RUNTIME_FIELDS if not hasattr(runtime_cfg, name)]
        if missing:
            raise AttributeError(
                f"runtime config {type(runtime_cfg).__name__} lacks {', '.join(missing)}; "
                "pass an object carrying the Dynamo runtime-config fields"
            )
        kwargs: dict[str, Any] = {
            "namespace": runtime_cfg.namespace,
            "component": getattr(runtime_cfg, "component", None) or "backend",
            "endpoint": getattr(runtime_cfg, "endpoint", None) or "generate",
            "model_name": model_name,
            "served_model_name": served_model_name,
            "kv_state_endpoint": getattr(runtime_cfg, "kv_state_endpoint", None),
            "endpoint_types": getattr(runtime_cfg, "endpoint_types", "chat,completions"),
            "discovery_backend": runtime_cfg.discovery_backend,
            "request_plane": runtime_cfg.request_plane,
            "event_plane": runtime_cfg.event_plane,
            "use_kv_events": getattr(runtime_cfg, "use_kv_events", False),
            "custom_jinja_template": getattr(runtime_cfg, "custom_jinja_template", None),
            "tool_call_parser": getattr(runtime_cfg, "dyn_tool_call_parser", None),
            "reasoning_parser": getattr(runtime_cfg, "dyn_reasoning_parser", None),
            "default_thinking_mode": getattr(runtime_cfg, "dyn_default_thinking_mode", None),
            "exclude_tools_when_tool_choice_none": getattr(
                runtime_cfg, "exclude_tools_when_tool_choice_none", True
            ),
            "enable_local_indexer": getattr(runtime_cfg, "enable_local_indexer", True),
            "enable_kv_routing": getattr(runtime_cfg, "enable_kv_routing", True),
            "structural_tag_mode": (
                "on" if getattr(runtime_cfg, "dyn_enable_structural_tag", False) else "off"
            ),
            "structural_tag_scope": getattr(runtime_cfg, "dyn_structural_tag_scope", "auto"),
            "structural_tag_schema": getattr(runtime_cfg, "dyn_structural_tag_schema", "auto"),
            "route_to_encoder": getattr(runtime_cfg, "route_to_encoder", False),
        }
        # vLLM/TRT-LLM configs call it `disaggregation_mode`, SGLang `serving_mode`. An
        # override skips the probe so a foreign enum never reaches the coercer.
        if "disaggregation_mode" not in overrides:
            kwargs["disaggregation_mode"] = coerce_disaggregation_mode(
                getattr(
                    runtime_cfg, "disaggregation_mode", getattr(runtime_cfg, "serving_mode", None)
                )
            )
        if model_input is not None:
            kwargs["model_input"] = model_input
        kwargs["health_check_payload"] = parse_health_check_payload_cli(
            getattr(runtime_cfg, "health_check_payload", None)
        )
        kwargs.update(overrides)
        return cls(**kwargs)
