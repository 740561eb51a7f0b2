"""The worker's ready pods, as the activator sees them, and where that view comes from.

A pod is *ready* when an EndpointSlice of the worker's Service lists it with
`conditions.ready` and its `DynamoWorkerMetadata` (named after the pod) exists: the same two
facts upstream's frontend joins. `ready_pods` is that join, pure. A `PodSource` produces the
inputs (the Kubernetes watches in `kube_source`, or `MemoryPodSource` in tests) and hands
each new list of pods to a `Fleet`, which the rest of the activator reads and waits on.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


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


PodSink = Callable[[list[ReadyPod]], None]


class PodSource(Protocol):
    """Produces the ready pods and hands every new list to `sink` until cancelled."""

    async def run(self, sink: PodSink) -> None: ...


class MemoryPodSource:
    """A pod source fed by hand (tests, and a place to see the interface at its simplest)."""

    def __init__(self, pods: Iterable[ReadyPod] = ()) -> None:
        self._pods = list(pods)
        self._sink: PodSink | None = None
        self._running = asyncio.Event()

    def set(self, pods: Iterable[ReadyPod]) -> None:
        """Publish a new list of ready pods."""
        self._pods = list(pods)
        if self._sink is not None:
            self._sink(list(self._pods))

    async def run(self, sink: PodSink) -> None:
        self._sink = sink
        sink(list(self._pods))
        self._running.set()
        await asyncio.Event().wait()  # until cancelled

    async def started(self) -> None:
        await self._running.wait()
