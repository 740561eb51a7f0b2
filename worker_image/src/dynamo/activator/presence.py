"""Presence: the activator in discovery, in the pods' place, while none of them serves.

It is present while it holds captured cards AND either no worker pod is ready or the worker
is scaled to zero (the operator's mark on its slice), and it is not shutting down. It then
publishes a DiscoveryMetadata of its own, the captured cards under its own instance id with
one Endpoint record pointing at its own TCP request plane, and marks itself ready in the
`<worker>-activator` EndpointSlice. Upstream's frontend keeps listing the model and routes
to the activator; clients of the worker's Service reach its HTTP port through the same
slice. Stepping in on the mark, while the last pod still serves (the operator keeps that pod
until the activator's endpoint is ready), leaves no moment with neither in discovery; a
request that reaches the activator meanwhile goes straight to that pod. Once a pod is ready
and the mark is gone it steps out: the slice's endpoint turns not ready and the metadata's
endpoints are emptied (the cards stay, as a draining worker's do). `decide` is the rule,
`presence_metadata` the record; a `Presence` does the I/O (`kube_presence.KubePresence` in a
cluster, `MemoryPresence` in tests).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

from dynamo.activator.cards import CapturedCards
from dynamo.runtime.discovery.records import kubernetes_instance_id, slugify
from dynamo.runtime.tcp_plane.address import endpoint_path, transport_address


def decide(
    *, cards_ready: bool, ready_pods: int, scaled_to_zero: bool, shutting_down: bool
) -> bool:
    """Whether the activator should be in discovery now."""
    return cards_ready and (ready_pods == 0 or scaled_to_zero) and not shutting_down


def served_endpoint(cards: CapturedCards) -> tuple[str, str, str]:
    """The `(namespace, component, endpoint)` the captured cards belong to (the base card's;
    one worker serves one endpoint)."""
    records = sorted(cards.records.items(), key=lambda item: bool(item[1].get("model_suffix")))
    _key, record = records[0]
    return record["namespace"], record["component"], record["endpoint"]


def presence_metadata(
    cards: CapturedCards, cr_name: str, tcp_host: str, tcp_port: int
) -> dict[str, Any]:
    """The activator's DiscoveryMetadata: the captured cards re-keyed to its instance id
    (derived from its object name as upstream derives it) and an Endpoint on its TCP plane."""
    instance_id = kubernetes_instance_id(cr_name)
    namespace, component, endpoint = served_endpoint(cards)
    base_key = f"{namespace}/{component}/{endpoint}/{instance_id:x}"
    path = endpoint_path(instance_id, namespace, component, endpoint)
    model_cards: dict[str, Any] = {}
    for record in cards.records.values():
        mine = copy.deepcopy(record)
        mine["instance_id"] = instance_id
        suffix = mine.get("model_suffix")
        key = f"{base_key}/{slugify(suffix)}" if suffix else base_key
        model_cards[key] = mine
    return {
        "endpoints": {
            base_key: {
                "type": "Endpoint",
                "component": component,
                "endpoint": endpoint,
                "namespace": namespace,
                "instance_id": instance_id,
                "transport": {"tcp": transport_address(tcp_host, tcp_port, path)},
                "device_type": "cpu",
                "request_plane_codec": "msgpack",
            }
        },
        "model_cards": model_cards,
        "event_channels": {},
        "event_sources": {},
    }


class Presence(Protocol):
    """Puts the activator in discovery and takes it out again. Idempotent."""

    async def step_in(self, metadata: dict[str, Any]) -> None:
        """Publish `metadata` and mark the activator ready for routing."""

    async def step_out(self) -> None:
        """Stop being routed to: no ready endpoint, metadata endpoints emptied."""

    async def close(self) -> None:
        """Release clients (the objects stay; the pod owns them)."""


class MemoryPresence:
    """A Presence that only remembers (tests; the in-process e2e)."""

    def __init__(self) -> None:
        self.metadata: dict[str, Any] | None = None
        self.present = False
        self.history: list[str] = []

    async def step_in(self, metadata: dict[str, Any]) -> None:
        self.metadata = copy.deepcopy(metadata)
        self.present = True
        self.history.append("in")

    async def step_out(self) -> None:
        if self.metadata is not None:
            self.metadata["endpoints"] = {}
        self.present = False
        self.history.append("out")

    async def close(self) -> None:
        return None
