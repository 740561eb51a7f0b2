"""Installing the CRDs the operator needs, at startup.

Our kinds (DynamoWorker, LoRAAdapter) are applied when the installed copy differs from the
models (so a restart with unchanged CRDs writes nothing). Upstream's DynamoWorkerMetadata is
created only when absent: a cluster that also runs upstream's platform keeps its own copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dynamo_operator.api.crd import (
    RESOURCES,
    custom_resource_definition,
    dynamo_worker_metadata_crd,
)
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import Cluster
from dynamo_operator.reconcile.converge import needs_apply, stamped

logger = logging.getLogger(__name__)


def _established(crd: dict[str, Any] | None) -> bool:
    if crd is None:
        return False
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


async def install_crds(cluster: Cluster, timeout_seconds: float = 60.0) -> list[str]:
    """Install or update the CRDs and wait until those written are Established; returns the
    names written."""
    written = []
    for resource in RESOURCES:
        manifest = stamped(custom_resource_definition(resource))
        name = manifest["metadata"]["name"]
        live = await cluster.get(kinds.CRD, None, name)
        if needs_apply(manifest, live):
            await cluster.apply(manifest)
            written.append(name)
            logger.info("Applied CRD %s", name)
    upstream = dynamo_worker_metadata_crd()
    if await cluster.create_crd_if_absent(upstream):
        written.append(upstream["metadata"]["name"])
        logger.info(
            "Created CRD %s (upstream Dynamo's; it was absent)", upstream["metadata"]["name"]
        )
    deadline = time.monotonic() + timeout_seconds
    for name in written:
        while not _established(await cluster.get(kinds.CRD, None, name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} is not Established after {timeout_seconds:.0f}s")
            await asyncio.sleep(0.5)
    return written
