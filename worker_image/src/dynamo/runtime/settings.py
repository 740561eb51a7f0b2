"""`RuntimeSettings`: every environment knob of the worker runtime, read once at startup.

Upstream names and defaults, except where noted as ours:

| variable | default | meaning |
|---|---|---|
| `DYN_SYSTEM_HOST` / `DYN_SYSTEM_PORT` | `0.0.0.0` / `-1` | system server; -1 off, 0 ephemeral |
| `DYN_SYSTEM_HEALTH_PATH` / `DYN_SYSTEM_LIVE_PATH` | `/health` / `/live` | probe paths |
| `DYN_SYSTEM_STARTING_HEALTH_STATUS` | `notready` | health before serving starts |
| `DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS` | (none) | endpoints that must be ready |
| `DYN_HEALTH_CHECK_ENABLED` | false | canary probes through the engine when idle |
| `DYN_CANARY_WAIT_TIME` / `DYN_HEALTH_CHECK_REQUEST_TIMEOUT` | 10 / 3 s | canary timing |
| `DYN_HTTP_HOST` / `DYN_HTTP_PORT` (ours) | `0.0.0.0` / `8000` | request plane; 0 = ephemeral |
| `DYN_REQUEST_PLANE` | `tcp` | `tcp`: also upstream's TCP plane (1); `http` (ours): not |
| `DYN_TCP_RPC_HOST` / `DYN_TCP_RPC_PORT` | (2) / `0` | TCP request plane; 0 = ephemeral |
| `DYN_TCP_MAX_MESSAGE_SIZE` | 33554432 | largest request frame accepted, in bytes |
| `DYN_EVENT_PLANE` | `zmq` | with the TCP plane: KV events/load on ZMQ; `nats`: off |
| `DYN_EVENT_PLANE_HOST` | the TCP plane's host | address the event sockets advertise |
| `DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS` | 5 | wait after unregistering, before draining |
| `DYN_PREFILL_DRAIN_TIMEOUT_S` | 30 | drain budget; here it applies to **every** mode |
| `DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT` | 30 | hard deadline (+ grace), else exit 911 |
| `DYN_LORA_ENABLED` | false | mounts `/v1/loras` (Rust truthiness: `on` counts) |
| `DYN_FORWARDPASS_METRIC_PORT` | (none) | ZMQ PUB port for forward-pass metrics; unset = off |
| `DYN_FORWARDPASS_METRIC_HOST` (ours) | `127.0.0.1` | interface for that socket |
| `DYN_TOKEN_BUDGET_COMBINED_LIMIT` (ours) | (none) | publish and enforce a token budget |
| `DYN_TOKEN_BUDGET_REJECT_PROMPT_OVERFLOW` (ours) | false | refuse prompts at/over the limit |
| `DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW` (ours) | false | refuse prompt + max_tokens over it |

(1) served beside the HTTP routes and advertised in discovery as the Endpoint's transport, so
upstream's frontend routes to this worker; with `http` the Endpoint advertises our HTTP URL,
which upstream's readers do not understand; upstream's `nats` is refused (no NATS here).
(2) unset: every interface, advertised as `POD_IP`, else 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from dynamo.common.token_budget import TokenBudget
from dynamo.runtime.env import env_flag, env_int, env_seconds, env_text

logger = logging.getLogger(__name__)

DEFAULT_GRACE_PERIOD_SECS = 5.0
DEFAULT_DRAIN_TIMEOUT_SECS = 30.0
DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_SECS = 30.0
# Upstream keeps this much of the hard deadline for cleanup when sizing the drain budget.
CLEANUP_RESERVE_SECS = 5.0


@dataclass(frozen=True)
class RuntimeSettings:
    """The runtime's settings (see the module table for the variables behind them)."""

    system_host: str = "0.0.0.0"
    system_port: int = -1
    health_path: str = "/health"
    live_path: str = "/live"
    starting_ready: bool = False
    use_endpoint_health_status: tuple[str, ...] = ()
    health_check_enabled: bool = False
    canary_wait_secs: float = 10.0
    health_check_timeout_secs: float = 3.0
    http_host: str = "0.0.0.0"
    http_port: int = 8000
    request_plane: str = "tcp"
    tcp_host: str | None = None
    tcp_port: int = 0
    tcp_max_message_bytes: int = 32 * 2**20
    event_plane: str | None = None
    event_plane_host: str | None = None
    grace_period_secs: float = DEFAULT_GRACE_PERIOD_SECS
    drain_timeout_secs: float = DEFAULT_DRAIN_TIMEOUT_SECS
    graceful_shutdown_timeout_secs: float = DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_SECS
    lora_enabled: bool = False
    fpm_host: str = "127.0.0.1"
    fpm_port: int | None = None
    token_budget: TokenBudget | None = None

    @property
    def drain_budget_secs(self) -> float:
        """How long in-flight requests may run after the grace period: the drain timeout,
        capped so cleanup keeps `CLEANUP_RESERVE_SECS` of the hard deadline."""
        cap = self.graceful_shutdown_timeout_secs - CLEANUP_RESERVE_SECS
        return max(0.0, min(self.drain_timeout_secs, cap))

    @property
    def hard_deadline_secs(self) -> float:
        """From the first signal, shutdown must be over within this, else exit 911."""
        return self.graceful_shutdown_timeout_secs + self.grace_period_secs

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeSettings:
        """Read every setting from `environ` (default `os.environ`)."""
        env = os.environ if environ is None else environ
        if env_text(env, "DYN_SYSTEM_ENABLED") is not None:
            logger.warning(
                "DYN_SYSTEM_ENABLED is deprecated and ignored; DYN_SYSTEM_PORT >= 0 enables "
                "the system status server"
            )
        fpm_port = env_text(env, "DYN_FORWARDPASS_METRIC_PORT")
        return cls(
            system_host=env_text(env, "DYN_SYSTEM_HOST") or "0.0.0.0",
            system_port=env_int(env, "DYN_SYSTEM_PORT", -1),
            health_path=env_text(env, "DYN_SYSTEM_HEALTH_PATH") or "/health",
            live_path=env_text(env, "DYN_SYSTEM_LIVE_PATH") or "/live",
            starting_ready=_starting_ready(env_text(env, "DYN_SYSTEM_STARTING_HEALTH_STATUS")),
            use_endpoint_health_status=parse_endpoint_list(
                env_text(env, "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS")
            ),
            health_check_enabled=env_flag(env, "DYN_HEALTH_CHECK_ENABLED"),
            canary_wait_secs=env_seconds(env, "DYN_CANARY_WAIT_TIME", 10.0),
            health_check_timeout_secs=env_seconds(env, "DYN_HEALTH_CHECK_REQUEST_TIMEOUT", 3.0),
            http_host=env_text(env, "DYN_HTTP_HOST") or "0.0.0.0",
            http_port=env_int(env, "DYN_HTTP_PORT", 8000),
            request_plane=request_plane_from_env(env),
            tcp_host=env_text(env, "DYN_TCP_RPC_HOST"),
            tcp_port=env_int(env, "DYN_TCP_RPC_PORT", 0),
            tcp_max_message_bytes=env_int(env, "DYN_TCP_MAX_MESSAGE_SIZE", 32 * 2**20),
            event_plane=env_text(env, "DYN_EVENT_PLANE"),
            event_plane_host=env_text(env, "DYN_EVENT_PLANE_HOST"),
            grace_period_secs=env_seconds(
                env, "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS", DEFAULT_GRACE_PERIOD_SECS
            ),
            drain_timeout_secs=env_seconds(
                env, "DYN_PREFILL_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_SECS
            ),
            graceful_shutdown_timeout_secs=env_seconds(
                env, "DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT", DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_SECS
            ),
            lora_enabled=env_flag(env, "DYN_LORA_ENABLED"),
            fpm_host=env_text(env, "DYN_FORWARDPASS_METRIC_HOST") or "127.0.0.1",
            fpm_port=None if fpm_port is None else env_int(env, "DYN_FORWARDPASS_METRIC_PORT", 0),
            token_budget=token_budget_from_env(env),
        )


def request_plane_from_env(environ: Mapping[str, str]) -> str:
    """`DYN_REQUEST_PLANE`: `tcp` (default, as upstream: upstream's TCP request plane beside
    our HTTP routes, advertised in discovery) or `http` (our HTTP routes only); ValueError
    for anything else (upstream's `nats` included: there is no NATS here)."""
    value = (env_text(environ, "DYN_REQUEST_PLANE") or "tcp").strip().lower()
    if value not in ("http", "tcp"):
        raise ValueError(
            f"DYN_REQUEST_PLANE={value!r} is not supported; use tcp (upstream's frontend "
            "routes here) or http (this worker's own HTTP routes only)"
        )
    return value


def _starting_ready(value: str | None) -> bool:
    if value is None:
        return False
    normalized = value.strip().lower()
    if normalized not in ("ready", "notready"):
        logger.warning(
            "DYN_SYSTEM_STARTING_HEALTH_STATUS=%r is neither 'ready' nor 'notready'; "
            "using 'notready'",
            value,
        )
    return normalized == "ready"


def parse_endpoint_list(value: str | None) -> tuple[str, ...]:
    """Endpoint names from a JSON array (`["generate"]`, as the operator sets it) or a
    comma-separated list."""
    if value is None:
        return ()
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
            return tuple(item for item in parsed if item)
        raise ValueError(
            f"DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS={value!r} is not a JSON array of strings"
        )
    return tuple(item.strip() for item in text.split(",") if item.strip())


def token_budget_from_env(environ: Mapping[str, str]) -> TokenBudget | None:
    """The operator's token budget, or None when `DYN_TOKEN_BUDGET_COMBINED_LIMIT` is unset.

    A non-integer or negative limit raises ValueError naming the variable.
    """
    limit = env_text(environ, "DYN_TOKEN_BUDGET_COMBINED_LIMIT")
    if limit is None:
        return None
    combined = env_int(environ, "DYN_TOKEN_BUDGET_COMBINED_LIMIT", 0)
    if combined < 0:
        raise ValueError(f"DYN_TOKEN_BUDGET_COMBINED_LIMIT={limit!r} must be >= 0")
    return TokenBudget(
        combined_limit=combined,
        reject_prompt_overflow=env_flag(environ, "DYN_TOKEN_BUDGET_REJECT_PROMPT_OVERFLOW"),
        reject_total_overflow=env_flag(environ, "DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW"),
    )
