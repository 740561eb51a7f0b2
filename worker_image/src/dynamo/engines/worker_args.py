"""The flags every engine shares, the `WorkerConfig` an engine's `from_args` returns, and
what the shared flags mean for a request (its forced data-parallel rank) and for the canary.

`dynamo-worker` passes an engine `--model`, `--served-model-name`, `--max-loras`, the
data-parallel flags and `--disaggregation-mode` when they are given; every engine also takes
`--namespace`, `--component` and `--endpoint`. The engine adds its own flags (and `--model`,
whose meaning is the engine's) to the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from dynamo.common.backend.disagg import DISAGGREGATION_MODES
from dynamo.common.backend.dp_rank import forced_dp_rank, validate_global_dp_rank
from dynamo.common.backend.engine import GenerateRequest
from dynamo.common.backend.health_check import bos_token_id_or, build_health_check_payload
from dynamo.common.backend.worker_config import WorkerConfig
from dynamo.common.constants import DisaggregationMode
from dynamo.common.utils.namespace import get_worker_namespace
from dynamo.runtime.settings import request_plane_from_env

DEFAULT_MAX_LORAS = 4

Settings = TypeVar("Settings")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Add the shared flags to an engine's parser."""
    add = parser.add_argument
    add(
        "--served-model-name",
        default=None,
        help="name clients use for the base model (default: the --model value)",
    )
    add(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help=f"adapters loaded at once (default {DEFAULT_MAX_LORAS})",
    )
    add(
        "--data-parallel-size",
        type=int,
        default=1,
        help="data-parallel ranks served by this engine (default 1)",
    )
    add(
        "--data-parallel-start-rank",
        type=int,
        default=0,
        help="global rank of this engine's first data-parallel rank (default 0)",
    )
    add(
        "--disaggregation-mode",
        default=DisaggregationMode.AGGREGATED.value,
        choices=DISAGGREGATION_MODES,
        help="the worker's role, as upstream's `python -m dynamo.vllm` names it: agg "
        "(default: prefill and decode), prefill (fill the KV cache for a decode worker to pull) "
        "or decode (generate from a prefill worker's KV cache)",
    )
    add("--namespace", default=None, help="Dynamo namespace (default $DYN_NAMESPACE or dynamo)")
    add(
        "--component",
        default=None,
        help="component name (default: prefill for a prefill worker, else backend, as upstream)",
    )
    add("--endpoint", default="generate", help="endpoint name (default generate)")


def worker_config(ns: argparse.Namespace) -> WorkerConfig:
    """The `WorkerConfig` for parsed flags; discovery and request plane from the
    environment (`DYN_DISCOVERY_BACKEND`, default mem; `DYN_REQUEST_PLANE`)."""
    mode = DisaggregationMode(ns.disaggregation_mode)
    return WorkerConfig(
        namespace=get_worker_namespace(ns.namespace),
        component=ns.component or default_component(mode),
        endpoint=ns.endpoint,
        model_name=ns.model,
        served_model_name=ns.served_model_name,
        discovery_backend=os.environ.get("DYN_DISCOVERY_BACKEND") or "mem",
        request_plane=request_plane_from_env(os.environ),
        disaggregation_mode=mode,
    )


def default_component(mode: DisaggregationMode) -> str:
    """Upstream's component for a role: prefill workers register under `prefill`, the rest
    under `backend` (its frontend finds each role there)."""
    return "prefill" if mode is DisaggregationMode.PREFILL else "backend"


def require_aggregated(parser: argparse.ArgumentParser, config: WorkerConfig, engine: str) -> None:
    """A usage error (exit 2) when an engine that cannot move its KV cache to another worker
    is asked to serve one role of a disaggregated pair."""
    if config.disaggregation_mode is not DisaggregationMode.AGGREGATED:
        parser.error(
            f"--disaggregation-mode {config.disaggregation_mode.value}: {engine} cannot hand "
            "its KV cache to another worker; use the vllm engine (with --kv-transfer-config) "
            "or --disaggregation-mode agg"
        )


# The shared flags' minimums, which every engine's settings are checked against too.
SHARED_MINIMUMS: Mapping[str, int] = {
    "max_loras": 0,
    "data_parallel_size": 1,
    "data_parallel_start_rank": 0,
}


def check_minimums(settings: object, minimums: Mapping[str, int] | None = None) -> None:
    """ValueError naming the field and its flag for the first setting below its minimum:
    the engine's `minimums`, then the shared flags' the settings have (None means unset
    and passes)."""
    shared = {name: low for name, low in SHARED_MINIMUMS.items() if hasattr(settings, name)}
    for name, minimum in {**(minimums or {}), **shared}.items():
        value = getattr(settings, name)
        if value is not None and value < minimum:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name} ({flag}) must be >= {minimum}, got {value}")


def settings_from(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, settings_cls: type[Settings]
) -> Settings:
    """An engine's settings dataclass (one field per flag) from parsed flags; a value the
    dataclass refuses is a usage error (`parser.error`, exit 2)."""
    assert dataclasses.is_dataclass(settings_cls)
    values: dict[str, Any] = {
        field.name: getattr(ns, field.name) for field in dataclasses.fields(settings_cls)
    }
    try:
        return settings_cls(**values)
    except ValueError as exc:
        parser.error(str(exc))


def engine_settings(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, settings_cls: type[Settings]
) -> tuple[Settings, WorkerConfig]:
    """`settings_from` and `worker_config` of the same parsed flags."""
    return settings_from(parser, ns, settings_cls), worker_config(ns)


def forced_rank(request: GenerateRequest, first: int, size: int, engine: str) -> int | None:
    """The global data-parallel rank the router forced (`routing.dp_rank`), checked against
    this engine's ranks `[first, first + size)`; None when it forced none."""
    return validate_global_dp_rank(forced_dp_rank(request), first, size, engine)


def canary_payload(tokenizer: Any) -> dict[str, Any]:
    """The health-check request every engine here answers: one greedy token from the
    tokenizer's BOS token."""
    return build_health_check_payload(bos_token_id_or(tokenizer))
