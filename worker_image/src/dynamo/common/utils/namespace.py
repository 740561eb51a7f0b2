"""Resolve the Dynamo namespace a worker registers in."""

from __future__ import annotations

import os

DEFAULT_NAMESPACE = "dynamo"


def get_worker_namespace(namespace: str | None = None) -> str:
    """Return `namespace`, else `$DYN_NAMESPACE`, else "dynamo", plus the worker suffix.

    When `DYN_NAMESPACE_WORKER_SUFFIX` is set (the operator sets it per worker hash), the
    result is `"<namespace>-<suffix>"`.
    """
    resolved = namespace or os.environ.get("DYN_NAMESPACE") or DEFAULT_NAMESPACE
    suffix = os.environ.get("DYN_NAMESPACE_WORKER_SUFFIX")
    if suffix:
        return f"{resolved}-{suffix}"
    return resolved
