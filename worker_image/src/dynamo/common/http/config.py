"""Operator-tunable settings of the outbound HTTP client (`DYN_HTTP_*`, flags `--http-*`).

Each client reads the environment once, when it is built. The legacy `DYN_MM_HTTP_*` names
are still honoured: each is copied to its canonical name when that is unset, with one
deprecation warning per legacy name per process (`DYN_MM_HTTP_READ_TIMEOUT` maps to
`DYN_HTTP_TIMEOUT`, as does `DYN_MM_HTTP_TIMEOUT`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

logger = logging.getLogger(__name__)

# Legacy name -> canonical name. Order matters: DYN_MM_HTTP_TIMEOUT is applied before its
# older alias DYN_MM_HTTP_READ_TIMEOUT, so the newer legacy name wins when both are set.
LEGACY_ENV_ALIASES: Final[dict[str, str]] = {
    "DYN_MM_HTTP_MAX_CONNECTIONS": "DYN_HTTP_MAX_CONNECTIONS",
    "DYN_MM_HTTP_TIMEOUT": "DYN_HTTP_TIMEOUT",
    "DYN_MM_HTTP_READ_TIMEOUT": "DYN_HTTP_TIMEOUT",
    "DYN_MM_HTTP_CONNECT_TIMEOUT": "DYN_HTTP_CONNECT_TIMEOUT",
    "DYN_MM_HTTP_MAX_KEEPALIVE": "DYN_HTTP_MAX_KEEPALIVE",
    "DYN_MM_HTTP_POOL_TIMEOUT": "DYN_HTTP_POOL_TIMEOUT",
    "DYN_MM_HTTP_CONCURRENCY": "DYN_HTTP_CONCURRENCY",
    "DYN_MM_HTTP_KEEPALIVE_TIMEOUT": "DYN_HTTP_KEEPALIVE_TIMEOUT",
}

_warned_legacy: set[str] = set()


@dataclass
class HttpConfigBase:
    """Knobs of the HTTP backends; each backend reads the fields that apply to it.

    `max_connections`: pool size (aiohttp `TCPConnector.limit`, httpx `max_connections`).
    `per_call_timeout_override`: when set, replaces the per-call `timeout` of every fetch
    (httpx: the read timeout; aiohttp: the total timeout).
    `connect_timeout`: TCP+TLS handshake budget (aiohttp `sock_connect`, httpx `connect`).
    `max_keepalive`: httpx idle keep-alive cap; 0 means "same as max_connections".
    `pool_timeout`: httpx wait for a free connection.
    `concurrency`: httpx in-flight fetch cap (a semaphore in front of the pool).
    `keepalive_timeout`: aiohttp idle connection lifetime.
    """

    max_connections: int = 100
    per_call_timeout_override: float | None = None
    connect_timeout: float = 5.0
    max_keepalive: int = 0
    pool_timeout: float = 60.0
    concurrency: int = 50
    keepalive_timeout: float = 15.0

    def __post_init__(self) -> None:
        _require(self.max_connections > 0, "max_connections", self.max_connections)
        if self.per_call_timeout_override is not None:
            _require(
                self.per_call_timeout_override > 0,
                "per_call_timeout_override",
                self.per_call_timeout_override,
            )
        _require(self.connect_timeout > 0, "connect_timeout", self.connect_timeout)
        _require(self.max_keepalive >= 0, "max_keepalive", self.max_keepalive, "0 or more")
        _require(self.pool_timeout > 0, "pool_timeout", self.pool_timeout)
        _require(self.concurrency > 0, "concurrency", self.concurrency)
        _require(self.keepalive_timeout > 0, "keepalive_timeout", self.keepalive_timeout)
        # 0 is the documented sentinel for "keep as many idle connections as the pool holds".
        if self.max_keepalive == 0:
            self.max_keepalive = self.max_connections

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> HttpConfigBase:
        """Build from a namespace parsed with a parser that `add_http_args` extended."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names})


def _require(ok: bool, name: str, value: object, expected: str = "greater than 0") -> None:
    if not ok:
        raise ValueError(f"HTTP setting {name} must be {expected}, got {value!r}")


def _optional_float(text: str) -> float | None:
    """Parse a float; empty or `None` means unset."""
    if text in ("", "None", "none"):
        return None
    return float(text)


# field name -> (canonical env var, CLI flag, parser, help)
_FIELDS: Final[dict[str, tuple[str, str, Callable[[str], Any], str]]] = {
    "max_connections": (
        "DYN_HTTP_MAX_CONNECTIONS",
        "--http-max-connections",
        int,
        "Total connection pool size.",
    ),
    "per_call_timeout_override": (
        "DYN_HTTP_TIMEOUT",
        "--http-timeout",
        _optional_float,
        "Replaces every fetch's own timeout (seconds): httpx read, aiohttp total.",
    ),
    "connect_timeout": (
        "DYN_HTTP_CONNECT_TIMEOUT",
        "--http-connect-timeout",
        float,
        "TCP+TLS handshake budget (seconds).",
    ),
    "max_keepalive": (
        "DYN_HTTP_MAX_KEEPALIVE",
        "--http-max-keepalive",
        int,
        "[httpx] Idle keep-alive connections kept; 0 = max connections.",
    ),
    "pool_timeout": (
        "DYN_HTTP_POOL_TIMEOUT",
        "--http-pool-timeout",
        float,
        "[httpx] Wait for a free pool slot (seconds).",
    ),
    "concurrency": (
        "DYN_HTTP_CONCURRENCY",
        "--http-concurrency",
        int,
        "[httpx] Process-wide cap on in-flight fetches.",
    ),
    "keepalive_timeout": (
        "DYN_HTTP_KEEPALIVE_TIMEOUT",
        "--http-keepalive-timeout",
        float,
        "[aiohttp] How long an idle connection stays open (seconds).",
    ),
}


def apply_legacy_env_aliases() -> None:
    """Copy each set `DYN_MM_HTTP_*` variable to its `DYN_HTTP_*` name when that is unset."""
    for legacy, canonical in LEGACY_ENV_ALIASES.items():
        value = os.environ.get(legacy)
        if value is None:
            continue
        if legacy not in _warned_legacy:
            _warned_legacy.add(legacy)
            logger.warning("%s is deprecated; use %s instead", legacy, canonical)
        if os.environ.get(canonical) is None:
            os.environ[canonical] = value


def _env_default(name: str) -> Any:
    env_var, _flag, parse, _help = _FIELDS[name]
    default = next(f.default for f in dataclasses.fields(HttpConfigBase) if f.name == name)
    raw = os.environ.get(env_var)
    if raw is None or raw.strip() == "":
        return default
    try:
        return parse(raw.strip())
    except ValueError:
        kind = "an integer" if parse is int else "a number"
        raise ValueError(f"{env_var} must be {kind}, got {raw!r}") from None


def from_env() -> HttpConfigBase:
    """Read every `DYN_HTTP_*` setting (after applying the legacy aliases)."""
    apply_legacy_env_aliases()
    return HttpConfigBase(**{name: _env_default(name) for name in _FIELDS})


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """Register the `--http-*` flags; their defaults come from the `DYN_HTTP_*` variables."""
    apply_legacy_env_aliases()
    group = parser.add_argument_group("HTTP client options")
    for name, (env_var, flag, parse, help_text) in _FIELDS.items():
        group.add_argument(
            flag,
            dest=name,
            type=parse,
            default=_env_default(name),
            help=f"{help_text} Env: {env_var}.",
        )
