"""The health state machine behind `/health` and `/live` (upstream's system health).

Overall health is, in order of precedence:
1. with `DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS` set: every listed endpoint is ready;
2. with canary targets registered: every target endpoint is ready;
3. otherwise: the system status (`DYN_SYSTEM_STARTING_HEALTH_STATUS` at first).

An endpoint turns ready when its request handler is serving and notready when it is removed.
Unlike upstream, whose system status stays at its starting value, this runtime also sets the
system status ready once serving starts and notready at shutdown, so `/health` answers 200
exactly while the worker serves, with or without the endpoint list.
"""

from __future__ import annotations

import time
from typing import Any


class HealthState:
    """Readiness of the system and of each served endpoint (by endpoint name)."""

    def __init__(
        self, *, starting_ready: bool = False, use_endpoint_health_status: tuple[str, ...] = ()
    ) -> None:
        self._system_ready = starting_ready
        self._required = use_endpoint_health_status
        self._endpoints: dict[str, bool] = {}
        self._targets: set[str] = set()
        self._started_ns = time.monotonic_ns()

    def set_system_ready(self, ready: bool) -> None:
        """Set the system status (upstream's `runtime.set_health_status`)."""
        self._system_ready = ready

    def set_endpoint_ready(self, endpoint: str, ready: bool) -> None:
        """Record an endpoint's readiness (serving started, canary result, removal)."""
        self._endpoints[endpoint] = ready

    def register_target(self, endpoint: str) -> None:
        """Make `endpoint` a canary target: it starts notready until a probe or real
        traffic succeeds."""
        self._targets.add(endpoint)
        self._endpoints.setdefault(endpoint, False)

    def is_targeted(self, endpoint: str) -> bool:
        """Whether `endpoint` is a canary target."""
        return endpoint in self._targets

    def is_healthy(self) -> bool:
        """The overall status (see the module docstring for the precedence)."""
        if self._required:
            return all(self._endpoints.get(name, False) for name in self._required)
        if self._targets:
            return all(self._endpoints.get(name, False) for name in self._targets)
        return self._system_ready

    def body(self) -> dict[str, Any]:
        """`{"status": "ready"|"notready", "uptime": {"secs", "nanos"}, "endpoints": {...}}`."""
        uptime_ns = time.monotonic_ns() - self._started_ns
        return {
            "status": "ready" if self.is_healthy() else "notready",
            "uptime": {"secs": uptime_ns // 1_000_000_000, "nanos": uptime_ns % 1_000_000_000},
            "endpoints": {
                name: "ready" if ready else "notready"
                for name, ready in sorted(self._endpoints.items())
            },
        }
