"""Canary (health-check) payloads: building them for engines and recognising them.

Engines return `build_health_check_payload(...)` from `health_check_payload()`; the
runtime sends it through `generate` when the endpoint is idle. Every payload carries the
marker `_HEALTH_CHECK: true` so `generate` can tell probes from real traffic (`is_probe`).
An operator override in `DYN_HEALTH_CHECK_PAYLOAD` (JSON text or `@/path/to/file.json`)
replaces the engine's payload wholesale.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

HEALTH_CHECK_KEY = "_HEALTH_CHECK"
HEALTH_CHECK_PAYLOAD_ENV = "DYN_HEALTH_CHECK_PAYLOAD"


def is_probe(request: Mapping[str, Any]) -> bool:
    """True when the request carries the canary marker."""
    return request.get(HEALTH_CHECK_KEY) is True


def _parse_payload(value: str, source: str) -> dict[str, Any] | None:
    """Parse JSON text, or `@path` naming a JSON file; None (with a warning) if invalid."""
    try:
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as handle:
                parsed = json.load(handle)
        else:
            parsed = json.loads(value)
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("Ignoring %s: cannot read it as JSON (%s)", source, exc)
        return None
    if not isinstance(parsed, dict):
        logger.warning(
            "Ignoring %s: it must be a JSON object, got %s", source, type(parsed).__name__
        )
        return None
    return parsed


def load_health_check_from_env(env_var: str = HEALTH_CHECK_PAYLOAD_ENV) -> dict[str, Any] | None:
    """Read the operator's canary override from `env_var` (unset or invalid: None)."""
    value = os.environ.get(env_var)
    if not value:
        return None
    return _parse_payload(value, env_var)


def _stamp_marker(payload: Mapping[str, Any]) -> dict[str, Any]:
    stamped = dict(payload)
    stamped[HEALTH_CHECK_KEY] = True
    return stamped


def _finalize(payload: dict[str, Any]) -> dict[str, Any]:
    # `is None`, not truthiness: an explicit `{}` override must win over the default.
    override = load_health_check_from_env()
    return _stamp_marker(override if override is not None else payload)


def build_health_check_payload(
    bos_token_id: int, *, extras: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Token canary (one BOS token, greedy, one output token) + `extras`, env override, marker."""
    payload: dict[str, Any] = {
        "token_ids": [bos_token_id],
        "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
    }
    if extras:
        payload.update(extras)
    return _finalize(payload)


def build_raw_health_check_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """Raw-engine canary: `payload` (or the env override) with the marker stamped."""
    return _finalize(dict(payload))


def bos_token_id_or(tokenizer: Any, default: int = 1) -> int:
    """Return the tokenizer's `bos_token_id` (also via a wrapper's `.tokenizer`), else `default`."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        bos = getattr(getattr(tokenizer, "tokenizer", None), "bos_token_id", None)
    return int(bos) if bos is not None else default


def parse_health_check_payload_cli(value: str | None) -> dict[str, Any] | None:
    """Parse a `--health-check-payload` value (JSON or `@/path`) and stamp the marker.

    Empty gives None; invalid input logs a warning and gives None, so the engine's own
    payload still applies.
    """
    if not value:
        return None
    parsed = _parse_payload(value, "--health-check-payload")
    return None if parsed is None else _stamp_marker(parsed)
