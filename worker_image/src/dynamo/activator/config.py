"""The activator's configuration, read from the environment the operator sets.

| variable | default | meaning |
|---|---|---|
| `DYN_ACTIVATOR_WORKER` | (required) | the DynamoWorker it stands in for (its Service name) |
| `POD_NAME` | (required) | this pod's name (downward API `metadata.name`) |
| `POD_NAMESPACE` | (required) | this pod's namespace (`metadata.namespace`) |
| `POD_UID` | (required) | this pod's uid (`metadata.uid`) |
| `POD_IP` | (required) | this pod's IP (`status.podIP`): advertised to the frontend and the slice |
| `DYN_ACTIVATOR_MAX_HELD` | `256` | requests held at once; more are refused at once (HTTP 503) |
| `DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS` | `300` | how long a request waits for a ready pod |
| `DYN_HTTP_PORT` | `8000` | OpenAI HTTP routes (the Service's `http` port) |
| `DYN_SYSTEM_PORT` | `9090` | system server: /health, /ready, /metrics, card files |
| `DYN_TCP_RPC_PORT` | `0` | upstream's TCP request plane (0 = ephemeral, as the worker's default) |
| `DYN_ACTIVATOR_BIND_HOST` | `0.0.0.0` | interface every listener binds |
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

ENV_WORKER = "DYN_ACTIVATOR_WORKER"
ENV_MAX_HELD = "DYN_ACTIVATOR_MAX_HELD"
ENV_HOLD_TIMEOUT = "DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS"
ENV_HTTP_PORT = "DYN_HTTP_PORT"
ENV_SYSTEM_PORT = "DYN_SYSTEM_PORT"
ENV_TCP_PORT = "DYN_TCP_RPC_PORT"
ENV_BIND_HOST = "DYN_ACTIVATOR_BIND_HOST"

DEFAULT_MAX_HELD = 256
DEFAULT_HOLD_TIMEOUT_S = 300.0
DEFAULT_HTTP_PORT = 8000
DEFAULT_SYSTEM_PORT = 9090
DEFAULT_TCP_PORT = 0


class ConfigError(ValueError):
    """A missing or malformed variable; the message names it."""


@dataclass(frozen=True)
class ActivatorConfig:
    """Everything the activator is told from outside."""

    worker: str
    pod_name: str
    namespace: str
    pod_uid: str
    pod_ip: str
    max_held: int = DEFAULT_MAX_HELD
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S
    http_port: int = DEFAULT_HTTP_PORT
    system_port: int = DEFAULT_SYSTEM_PORT
    tcp_port: int = DEFAULT_TCP_PORT
    bind_host: str = "0.0.0.0"

    @property
    def activator_slice(self) -> str:
        """The EndpointSlice the operator creates for this activator: `<worker>-activator`."""
        return f"{self.worker}-activator"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ActivatorConfig:
        """Read and check every variable; ConfigError naming the first bad one."""
        required = {
            name: environ.get(name, "").strip()
            for name in (ENV_WORKER, "POD_NAME", "POD_NAMESPACE", "POD_UID", "POD_IP")
        }
        for name, value in required.items():
            if not value:
                raise ConfigError(f"{name} must be set (see dynamo-activator --help)")
        try:
            ipaddress.ip_address(required["POD_IP"])
        except ValueError:
            raise ConfigError(
                f"POD_IP {required['POD_IP']!r} is not an IP address (set it from status.podIP)"
            ) from None
        return cls(
            worker=required[ENV_WORKER],
            pod_name=required["POD_NAME"],
            namespace=required["POD_NAMESPACE"],
            pod_uid=required["POD_UID"],
            pod_ip=required["POD_IP"],
            max_held=_int(environ, ENV_MAX_HELD, DEFAULT_MAX_HELD, minimum=1),
            hold_timeout_s=_seconds(environ, ENV_HOLD_TIMEOUT, DEFAULT_HOLD_TIMEOUT_S),
            http_port=_port(environ, ENV_HTTP_PORT, DEFAULT_HTTP_PORT),
            system_port=_port(environ, ENV_SYSTEM_PORT, DEFAULT_SYSTEM_PORT),
            tcp_port=_port(environ, ENV_TCP_PORT, DEFAULT_TCP_PORT),
            bind_host=environ.get(ENV_BIND_HOST, "").strip() or "0.0.0.0",
        )


def _int(environ: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name} must be a positive, finite number of seconds, got {raw!r}")
    return value


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    value = _int(environ, name, default, minimum=0)
    if value > 65535:
        raise ConfigError(f"{name} must be a TCP port (0-65535), got {value}")
    return value
