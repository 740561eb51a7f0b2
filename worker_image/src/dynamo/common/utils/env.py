"""Environment-variable parsing used by LoRA and engine settings."""

from __future__ import annotations

import os

# Deliberately narrower than the other boolean parsers in Dynamo: no strip, and "on" is
# false. LoRA's `DYN_LORA_ENABLED` relies on this exact behaviour.
_TRUE_VALUES = ("true", "1", "yes")


def env_bool(name: str, default: bool = False) -> bool:
    """Read `name` as a boolean: unset or empty gives `default`, else true/1/yes (any case)."""
    raw = os.environ.get(name)
    if not raw:
        return default
    return raw.lower() in _TRUE_VALUES
