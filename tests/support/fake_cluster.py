"""A fake of the operator's `Cluster` for unit tests of a whole reconcile: just enough of the API
server (objects by kind, namespace and name; deletions and Events recorded), no I/O."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from dynamo_operator.k8s import kinds


class FakeCluster:
    """Objects by (kind, namespace, name). `has_crds` answers every CRD check (the
    PodMonitor's)."""

    def __init__(self, *, has_crds: bool = True) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.deleted: list[tuple[str, str]] = []
        self.events: list[Mapping[str, Any]] = []
        self.version = 0
        self.has_crds = has_crds

    async def get(self, kind: kinds.Kind, namespace: str | None, name: str) -> Any:
        return copy.deepcopy(self.objects.get((kind.kind, namespace or "", name)))

    async def list(self, kind: kinds.Kind, namespace: str | None, selector: str | None) -> Any:
        return []

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(dict(manifest))
        meta = obj["metadata"]
        old = self.objects.get((obj["kind"], meta["namespace"], meta["name"]), {})
        # Server-side apply keeps the fields another manager owns, such as the endpoints the
        # activator writes into its own EndpointSlice.
        if "endpoints" in old and "endpoints" not in obj:
            obj["endpoints"] = old["endpoints"]
        meta |= {"uid": f"uid-{meta['name']}-{obj['kind']}", "resourceVersion": str(self.version)}
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = obj
        return copy.deepcopy(obj)

    async def delete(self, kind: kinds.Kind, namespace: str | None, name: str, uid: str) -> bool:
        self.deleted.append((kind.kind, name))
        return self.objects.pop((kind.kind, namespace or "", name), None) is not None

    async def patch_status(
        self, kind: kinds.Kind, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "1"}}

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        self.events.append(event)

    async def crd_exists(self, name: str) -> bool:
        return self.has_crds
