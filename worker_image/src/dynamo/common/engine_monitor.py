"""Settings for the engine health monitor that backends run beside their engine.

The monitor calls the engine's health check every `interval` seconds (each call bounded by
`check_timeout`, 0 = no bound); on a dead engine it shuts the engine down within
`shutdown_timeout` seconds (0 = no bound) and exits the worker.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INTERVAL_ENV = "DYN_ENGINE_HEALTH_CHECK_INTERVAL"
CHECK_TIMEOUT_ENV = "DYN_ENGINE_HEALTH_CHECK_TIMEOUT"
SHUTDOWN_TIMEOUT_ENV = "DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT"

DEFAULT_INTERVAL = 2.0
DEFAULT_CHECK_TIMEOUT = 30.0
DEFAULT_SHUTDOWN_TIMEOUT = 60.0


def _seconds(name: str, explicit: float | None, default: float) -> float:
    """Resolve one setting: explicit value, else env var, else default; clamp below at 0."""
    if explicit is not None:
        raw: object = explicit
        source = "argument"
    else:
        env_value = os.environ.get(name)
        if env_value is None or not env_value.strip():
            return default
        raw = env_value
        source = name
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        logger.warning("Invalid %s value %r for %s; using default %s", source, raw, name, default)
        return default
    if not math.isfinite(value):
        logger.warning("Non-finite %s value %r (%s); using default %s", source, raw, name, default)
        return default
    return max(value, 0.0)


@dataclass(frozen=True)
class EngineHealthMonitorConfig:
    """How often to check engine health, and how long checks and shutdown may take (s)."""

    interval: float
    check_timeout: float
    shutdown_timeout: float

    @classmethod
    def from_env(
        cls,
        *,
        interval: float | None = None,
        check_timeout: float | None = None,
        shutdown_timeout: float | None = None,
    ) -> EngineHealthMonitorConfig:
        """Build the config: explicit arguments win, else the `DYN_ENGINE_HEALTH_*` env vars.

        Invalid or non-finite values fall back to the default (with a warning); negative
        values become 0.
        """
        return cls(
            interval=_seconds(INTERVAL_ENV, interval, DEFAULT_INTERVAL),
            check_timeout=_seconds(CHECK_TIMEOUT_ENV, check_timeout, DEFAULT_CHECK_TIMEOUT),
            shutdown_timeout=_seconds(
                SHUTDOWN_TIMEOUT_ENV, shutdown_timeout, DEFAULT_SHUTDOWN_TIMEOUT
            ),
        )
