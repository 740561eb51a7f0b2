"""Reading children from the watch-fed index (`reconcile.children`): what the index keeps, and
the operator's own writes bridging the time until the watch reports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from dynamo_operator.k8s import kinds
from dynamo_operator.reconcile.children import CachedChild, ChildKey, ChildReader, key_of

pytestmark = pytest.mark.unit


@dataclass
class Index:
    """An index as the watches fill it (a plain dict of records)."""

    records: dict[ChildKey, CachedChild] = field(default_factory=dict)

    def watches(self, kind: kinds.Kind) -> bool:
        return kind is not kinds.POD_MONITOR

    def get(self, key: ChildKey) -> CachedChild | None:
        return self.records.get(key)

    def put(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        self.records[("Service", meta["namespace"], meta["name"])] = CachedChild.of(body)


def service(version: str, **spec: Any) -> dict[str, Any]:
    meta = {"name": "llm", "namespace": "ns", "uid": "u1", "resourceVersion": version}
    return {"kind": "Service", "metadata": meta, "spec": spec}


def test_a_record_keeps_what_reconciles_read_and_drops_the_rest() -> None:
    deployment = {
        "kind": "Deployment",
        "metadata": {"name": "a", "uid": "u", "resourceVersion": "7", "managedFields": [{"x": 1}]},
        "spec": {"replicas": 2},
        "status": {"readyReplicas": 1},
    }
    record = CachedChild.of(deployment)
    assert (record.uid, record.resource_version) == ("u", "7")
    assert record.body() == {
        "kind": "Deployment",
        "metadata": {"name": "a", "uid": "u", "resourceVersion": "7"},
        "spec": {"replicas": 2},
        "status": {"readyReplicas": 1},  # a Deployment's status feeds the worker's
    }
    assert "status" not in CachedChild.of({**service("1"), "status": {"x": 1}}).body()
    # Packed: a record is much smaller than the object's JSON (a Deployment is a few KiB).
    big = {**deployment, "spec": {"template": {"spec": {"containers": [{"env": ["x" * 40] * 50}]}}}}
    assert len(CachedChild.of(big).packed) < 400


async def test_reads_come_from_the_index_and_own_writes_until_the_watch_catches_up() -> None:
    index = Index()
    # No cluster at all: a watched kind is never read from the API server.
    reader = ChildReader(cluster=None)  # type: ignore[arg-type]
    key = key_of(kinds.SERVICE, "ns", "llm")

    async def live() -> dict[str, Any] | None:
        return await reader.live(index, kinds.SERVICE, "ns", "llm")

    assert await live() is None
    # Our apply created it; the watch has not reported it yet: the apply's answer is current.
    reader.wrote(kinds.SERVICE, "ns", "llm", service("5", port=1))
    assert (await live() or {})["spec"] == {"port": 1}
    # The watch delivers the same version: the index is current, the bridge goes.
    index.put(service("5", port=1))
    assert (await live() or {})["spec"] == {"port": 1}
    assert reader._written == {}
    # Our next apply; the index still has the older version: the apply's answer wins.
    reader.wrote(kinds.SERVICE, "ns", "llm", service("6", port=2))
    assert (await live() or {})["spec"] == {"port": 2}
    # The watch delivered a later version (a controller's write) before our answer was
    # handled: the later version wins, our answer must not hide it.
    index.put(service("7", port=3))
    reader.seen(key)
    reader.wrote(kinds.SERVICE, "ns", "llm", service("6", port=2))
    assert (await live() or {})["spec"] == {"port": 3}
    assert reader._written == {}
    # Deleted out of band: the watch reports it, and the reader sees it gone.
    del index.records[key]
    reader.seen(key)
    assert await live() is None
    # Our own delete: gone at once, even while the index still holds it.
    index.put(service("8"))
    reader.wrote(kinds.SERVICE, "ns", "llm", None)
    assert await live() is None
    reader.seen(key)
    assert await live() is not None  # whatever the watch says next (here: recreated)
