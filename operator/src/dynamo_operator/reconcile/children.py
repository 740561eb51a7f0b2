"""Reading a DynamoWorker's children from memory instead of from the API server.

The handlers keep a watch-fed index of the children the operator manages (those labelled
`app.kubernetes.io/managed-by: dynamo-operator`), one `CachedChild` per object: the object
without what no reconcile reads (`metadata.managedFields`, and the status of every kind but a
Deployment), packed as compressed JSON, so thousands of children stay a few MiB.

`ChildReader` is what a reconcile reads through: the index for the kinds the operator watches,
the API server for any other. After its own apply it uses the object that apply returned until
the watch reports that child again, so the next pass neither applies the same manifest twice
nor misses its own write.

A stale index never duplicates or orphans a child: an apply is a server-side apply of a
deterministic name (an object the index has not seen yet is updated, never created twice), a
delete carries the uid as a precondition, and every change of a child wakes its owner, whose
next pass sees it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import Cluster

ChildKey = tuple[str, str, str]  # (kind, namespace, name)
# The status a reconcile reads: a Deployment's (replica counts, rollout conditions), the model
# cache's claim (bound or lost) and fill Job (complete or failed).
_STATUS_READ = {kinds.DEPLOYMENT.kind, kinds.PERSISTENT_VOLUME_CLAIM.kind, kinds.JOB.kind}


@dataclass(frozen=True)
class CachedChild:
    """One child as the index holds it."""

    uid: str
    resource_version: str
    packed: bytes

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> CachedChild:
        """The record of the live object `body`."""
        kind = body.get("kind")
        obj = {k: v for k, v in body.items() if k != "status" or kind in _STATUS_READ}
        meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
        obj["metadata"] = meta
        text = json.dumps(obj, separators=(",", ":"))
        packed = zlib.compress(text.encode(), 1)
        return cls(str(meta.get("uid", "")), str(meta.get("resourceVersion", "")), packed)

    def body(self) -> dict[str, Any]:
        """The object, as a fresh dict."""
        body: dict[str, Any] = json.loads(zlib.decompress(self.packed))
        return body


def key_of(kind: kinds.Kind, namespace: str, name: str) -> ChildKey:
    return (kind.kind, namespace, name)


class ChildIndex(Protocol):
    """The watch-fed index of the operator's children."""

    def watches(self, kind: kinds.Kind) -> bool:
        """Whether the index holds every child of `kind` (the operator watches the kind)."""

    def get(self, key: ChildKey) -> CachedChild | None:
        """The child, or None when the index holds none of that kind and name."""


@dataclass
class ChildReader:
    """Reads children for reconciles; one per operator, shared by all objects."""

    cluster: Cluster
    # Per child: what our last write left (None: deleted), until the watch reports the child.
    _written: dict[ChildKey, CachedChild | None] = field(default_factory=dict, init=False)

    async def live(
        self, index: ChildIndex | None, kind: kinds.Kind, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """The child (None: absent), from memory when `kind` is watched. Raises ApiError."""
        if index is None or not index.watches(kind):
            return await self.cluster.get(kind, namespace, name)
        key = key_of(kind, namespace, name)
        record = index.get(key)
        if key in self._written:
            mine = self._written[key]
            if mine is not None and record is not None and not _older(record, mine):
                # The index holds our write, or a later version: the watch delivered that one
                # before our apply's answer was handled (the Deployment controller's status
                # update, say), so our answer must not hide it.
                del self._written[key]
            else:
                record = mine
        return record.body() if record is not None else None

    def wrote(
        self, kind: kinds.Kind, namespace: str, name: str, result: Mapping[str, Any] | None
    ) -> None:
        """Our apply of the child returned `result` (None: we deleted it)."""
        self._written[key_of(kind, namespace, name)] = (
            CachedChild.of(result) if result is not None else None
        )

    def seen(self, key: ChildKey) -> None:
        """The watch reported the child (changed, created or deleted): the index is current."""
        self._written.pop(key, None)


def _older(record: CachedChild, mine: CachedChild) -> bool:
    """Whether the index's `record` is an older version than our write `mine`. The API
    server's resourceVersions are integers that grow with every write (comparable by
    contract since Kubernetes 1.35); anything else counts as older, so that our own write
    stays in front until the watch reports that very version."""
    if record.resource_version == mine.resource_version:
        return False
    theirs, ours = record.resource_version, mine.resource_version
    if theirs.isdigit() and ours.isdigit():
        return int(theirs) < int(ours)
    return True
