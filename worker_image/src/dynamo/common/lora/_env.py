"""Environment parsing shared by the LoRA modules (the parsers differ on purpose)."""

from __future__ import annotations

import os
from typing import Final

TIMEOUT_ENV: Final = "LORA_DOWNLOAD_TIMEOUT_SECS"
DEFAULT_TIMEOUT_SECS: Final = 3600.0


def env_truthy(name: str) -> bool:
    """Rust-side flag parser (used where upstream reads the variable in Rust): trimmed,
    case-insensitive `1`, `true`, `on` or `yes`."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def download_timeout() -> float:
    """Seconds one file download (and the wait for another process's download) may take:
    `LORA_DOWNLOAD_TIMEOUT_SECS`, default 3600."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_SECS
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; fix or unset it"
        )
    return value
