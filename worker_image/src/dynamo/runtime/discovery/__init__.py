"""Discovery: publishing this worker where upstream Dynamo components look for workers.

`backend_from_env` picks the backend named by `DYN_DISCOVERY_BACKEND`:

* `kubernetes`: the pod's DynamoWorkerMetadata object (POD_NAME/POD_NAMESPACE/POD_UID);
* `file`: upstream's file layout under `$DYN_FILE_KV` (default `$TMPDIR/dynamo_store_kv`);
* `mem` (the default here): in memory only, so the worker runs anywhere.

Upstream's `etcd` and `nats` backends are not implemented.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from dynamo.runtime.discovery.base import (
    AdapterCard,
    DiscoveryBackend,
    EndpointAddress,
    WorkerAdvertisement,
)
from dynamo.runtime.discovery.records import JSON_SAFE_MASK

log = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("kubernetes", "file", "mem")

__all__ = [
    "SUPPORTED_BACKENDS",
    "AdapterCard",
    "DiscoveryBackend",
    "EndpointAddress",
    "WorkerAdvertisement",
    "backend_from_env",
    "backend_name",
    "instance_id_from_env",
]


def backend_name(environ: Mapping[str, str] = os.environ) -> str:
    """The backend `DYN_DISCOVERY_BACKEND` names (`mem` when unset); ValueError for others."""
    raw = environ.get("DYN_DISCOVERY_BACKEND", "").strip().lower()
    if not raw:
        return "mem"
    if raw not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"DYN_DISCOVERY_BACKEND={raw!r} is not supported by this worker runtime;"
            f" use one of: {', '.join(SUPPORTED_BACKENDS)}"
        )
    return raw


def backend_from_env(environ: Mapping[str, str] = os.environ) -> DiscoveryBackend:
    """The discovery backend `DYN_DISCOVERY_BACKEND` selects, configured from `environ`."""
    name = backend_name(environ)
    if name == "kubernetes":
        from dynamo.runtime.discovery.kubernetes import KubernetesBackend

        return KubernetesBackend.from_env(environ)
    if name == "file":
        from dynamo.runtime.discovery.file import FileBackend

        root = environ.get("DYN_FILE_KV") or str(
            Path(environ.get("TMPDIR") or "/tmp") / "dynamo_store_kv"
        )
        log.info("discovery: upstream file layout under %s", root)
        return FileBackend(root)
    from dynamo.runtime.discovery.mem import MemBackend

    if not environ.get("DYN_DISCOVERY_BACKEND"):
        log.info(
            "discovery: DYN_DISCOVERY_BACKEND is not set; keeping the records in memory"
            " (set kubernetes or file to publish them)"
        )
    return MemBackend()


def instance_id_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """This process's instance id: in Kubernetes mode the id upstream derives from the object
    name (the pod name); otherwise a random id small enough for any JSON reader (< 2**53)."""
    if backend_name(environ) == "kubernetes":
        from dynamo.runtime.discovery.kubernetes import PodIdentity

        return PodIdentity.from_env(environ).instance_id
    return secrets.randbelow(JSON_SAFE_MASK) + 1
