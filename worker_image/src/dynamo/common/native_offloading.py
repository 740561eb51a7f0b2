"""Advertise and read a backend's native KV-offloading capacity (in tokens).

Producers put `native_offloading_capacity(...)` into the model card's `runtime_data`; the
Rust router reads `runtime_data.native_offloading_capacity.total_tokens` as an unsigned int.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

NATIVE_OFFLOADING_CAPACITY_RUNTIME_KEY = "native_offloading_capacity"
_TOTAL_TOKENS_KEY = "total_tokens"


def _positive_token_count(total_tokens: object) -> int | None:
    # bool is an int subclass; True must not advertise a capacity of one token.
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int | float):
        return None
    if isinstance(total_tokens, float) and not math.isfinite(total_tokens):
        return None
    if total_tokens <= 0:
        return None
    count = int(total_tokens)
    # A fraction such as 0.5 is positive but truncates to zero tokens.
    return count if count > 0 else None


def native_offloading_capacity(total_tokens: object) -> dict[str, int] | None:
    """Build runtime metadata from an authoritative backend token capacity.

    Returns `{"total_tokens": n}`, or None when the value is not a positive finite number
    (bools, NaN, infinities, zero and negatives are all refused).
    """
    count = _positive_token_count(total_tokens)
    if count is None:
        return None
    return {_TOTAL_TOKENS_KEY: count}


def get_native_offloading_capacity_tokens(runtime_data: object) -> int | None:
    """Read native offloading capacity from a worker's runtime metadata, or None."""
    if not isinstance(runtime_data, Mapping):
        return None
    capacity = runtime_data.get(NATIVE_OFFLOADING_CAPACITY_RUNTIME_KEY)
    if not isinstance(capacity, Mapping):
        return None
    return _positive_token_count(capacity.get(_TOTAL_TOKENS_KEY))
