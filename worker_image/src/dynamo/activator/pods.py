"""The worker's ready pods, as the activator sees them, and where that view comes from.

A pod is *ready* when an EndpointSlice of the worker's Service lists it with
`conditions.ready` and its `DynamoWorkerMetadata` (named after the pod) exists: the same two
facts upstream's frontend joins. `ready_pods` is that join, pure. Beside the pods, the
activator reads one fact off its own EndpointSlice: whether the operator marked the worker
scaled to zero (`scaled_to_zero`), its cue to step in while the last pod still serves.
`worker_view` makes both a `WorkerView`, pure. A `PodSource` produces the views (the
Kubernetes watches in `kube_source`, or `MemoryPodSource` in tests); the pods go to a
`Fleet`, which the rest of the activator reads and waits on.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# On the activator's own EndpointSlice while the DynamoWorker's spec.replicas is 0; the
# operator sets it (`dynamo_operator.reconcile.dynamoworker.labels`, the same name).
SCALED_TO_ZERO_ANNOTATION = "dynamo.dev/scaled-to-zero"


@dataclass(frozen=True)
class ReadyPod:
    """One ready worker pod: where to send requests and what it published."""

    name: str
    http_url: str  # http://<pod ip>:<http port>
    tcp_address: str | None  # `ip:port/path` of its TCP request plane, if it serves one
    models: frozenset[str]  # base model and loaded adapters, by their served names
    metadata: Mapping[str, Any] = field(compare=False, hash=False)  # its spec.data

    def serves(self, model: str | None) -> bool:
        """Whether a request for `model` (None: any model) can go to this pod."""
        return model is None or model in self.models


def served_models(metadata: Mapping[str, Any]) -> frozenset[str]:
    """The model names a DiscoveryMetadata's cards list (base and LoRA cards)."""
    names = set()
    for record in (metadata.get("model_cards") or {}).values():
        name = (record.get("card_json") or {}).get("display_name")
        if isinstance(name, str) and name:
            names.add(name)
    return frozenset(names)


def tcp_address(metadata: Mapping[str, Any]) -> str | None:
    """The first Endpoint record's `transport.tcp` (`ip:port/path`), if any."""
    for _key, record in sorted((metadata.get("endpoints") or {}).items()):
        transport = record.get("transport") or {}
        if isinstance(transport.get("tcp"), str):
            return str(transport["tcp"])
    return None


def ready_pods(
    slices: Iterable[Mapping[str, Any]],
    metadata_by_name: Mapping[str, Mapping[str, Any]],
    http_port: int,
) -> list[ReadyPod]:
    """Join the Service's EndpointSlices with the pods' DiscoveryMetadata (`spec.data` by
    object name): every pod listed ready whose metadata exists and lists an endpoint (a
    draining worker empties its endpoints before its readiness drops), sorted by name."""
    found: dict[str, ReadyPod] = {}
    for endpoint_slice in slices:
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            ref = endpoint.get("targetRef") or {}
            name, addresses = ref.get("name"), endpoint.get("addresses") or []
            if conditions.get("ready") is not True or not name or not addresses:
                continue
            metadata = metadata_by_name.get(name)
            if metadata is None or not metadata.get("endpoints"):
                continue
            host = addresses[0]
            shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
            found[name] = ReadyPod(
                name=name,
                http_url=f"http://{shown}:{http_port}",
                tcp_address=tcp_address(metadata),
                models=served_models(metadata),
                metadata=metadata,
            )
    return [found[name] for name in sorted(found)]


def scaled_to_zero(activator_slice: Mapping[str, Any] | None) -> bool:
    """Whether the operator marked the activator's own EndpointSlice: the worker's
    spec.replicas is 0, so its last pod is about to go."""
    annotations = ((activator_slice or {}).get("metadata") or {}).get("annotations") or {}
    return annotations.get(SCALED_TO_ZERO_ANNOTATION) == "true"


@dataclass(frozen=True)
class WorkerView:
    """What the activator follows of its worker: the ready pods, and whether the worker is
    scaled to zero (see `scaled_to_zero`)."""

    pods: tuple[ReadyPod, ...]
    scaled_to_zero: bool = False


def worker_view(
    slices: Mapping[str, Mapping[str, Any]],
    metadata_by_name: Mapping[str, Mapping[str, Any]],
    activator_slice: str,
    http_port: int,
) -> WorkerView:
    """The view from the worker Service's EndpointSlices (by name) and the pods' metadata:
    the ready pods of every slice but the activator's own, and the operator's mark on that
    one."""
    workers = [s for name, s in slices.items() if name != activator_slice]
    return WorkerView(
        tuple(ready_pods(workers, metadata_by_name, http_port)),
        scaled_to_zero(slices.get(activator_slice)),
    )


class Fleet:
    """The current ready pods; waiters are woken on every change."""

    def __init__(self) -> None:
        self._pods: tuple[ReadyPod, ...] = ()
        self._changed = asyncio.Event()
        self._next = 0  # round-robin position

    @property
    def pods(self) -> tuple[ReadyPod, ...]:
        return self._pods

    def update(self, pods: Iterable[ReadyPod]) -> None:
        """Replace the view and wake every waiter."""
        self._pods = tuple(pods)
        self._changed.set()
        self._changed = asyncio.Event()

    def pick(self, model: str | None, exclude: frozenset[str] = frozenset()) -> ReadyPod | None:
        """A ready pod serving `model` (round robin), not one named in `exclude`."""
        eligible = [p for p in self._pods if p.serves(model) and p.name not in exclude]
        if not eligible:
            return None
        self._next += 1
        return eligible[self._next % len(eligible)]

    def next_change(self) -> asyncio.Event:
        """An event set at the next `update`. Take it *before* looking at the pods, so an
        update between the look and the wait is not missed."""
        return self._changed


ViewSink = Callable[[WorkerView], None]


class PodSource(Protocol):
    """Produces the worker's view and hands every new one to `sink` until cancelled."""

    async def run(self, sink: ViewSink) -> None: ...


class MemoryPodSource:
    """A pod source fed by hand (tests, and a place to see the interface at its simplest)."""

    def __init__(self, pods: Iterable[ReadyPod] = ()) -> None:
        self._view = WorkerView(tuple(pods))
        self._sink: ViewSink | None = None
        self._running = asyncio.Event()

    def set(self, pods: Iterable[ReadyPod]) -> None:
        """Publish a new list of ready pods."""
        self._publish(WorkerView(tuple(pods), self._view.scaled_to_zero))

    def mark_scaled_to_zero(self, marked: bool) -> None:
        """Publish the operator's mark (or its removal), the pods unchanged."""
        self._publish(WorkerView(self._view.pods, marked))

    async def run(self, sink: ViewSink) -> None:
        self._sink = sink
        sink(self._view)
        self._running.set()
        await asyncio.Event().wait()  # until cancelled

    async def started(self) -> None:
        await self._running.wait()

    def _publish(self, view: WorkerView) -> None:
        self._view = view
        if self._sink is not None:
            self._sink(view)
