"""Presence: in discovery while it holds cards and no pod is ready or the operator marked the
worker scaled to zero, out once a pod is ready and the mark is gone; the record it publishes
and the slice entry it applies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dynamo.activator.app import Activator
from dynamo.activator.cards import CapturedCards
from dynamo.activator.config import ActivatorConfig
from dynamo.activator.kube_presence import slice_apply
from dynamo.activator.pods import (
    SCALED_TO_ZERO_ANNOTATION,
    MemoryPodSource,
    ReadyPod,
    scaled_to_zero,
    served_models,
    tcp_address,
    worker_view,
)
from dynamo.activator.presence import MemoryPresence, decide, presence_metadata
from dynamo.runtime.discovery.base import AdapterCard, EndpointAddress, WorkerAdvertisement
from dynamo.runtime.discovery.records import discovery_metadata, kubernetes_instance_id
from dynamo_operator.reconcile.dynamoworker import labels as operator_labels

pytestmark = pytest.mark.unit

CONFIG = ActivatorConfig(
    worker="llama",
    pod_name="llama-activator-7d9f",
    namespace="team-a",
    pod_uid="uid-a",
    pod_ip="127.0.0.1",
    http_port=0,
    system_port=0,
    bind_host="127.0.0.1",
)


def pod_metadata(pod: str = "llama-0") -> dict[str, Any]:
    return discovery_metadata(
        WorkerAdvertisement(
            address=EndpointAddress("dynamo", "backend", "generate"),
            instance_id=kubernetes_instance_id(pod),
            served_model_name="llama",
            model=str(Path("/nowhere")),
            transport={"tcp": "10.0.0.7:9345/x/dynamo/backend/generate"},
            request_plane_codec="msgpack",
            adapters=(AdapterCard("SQL.lora", 1, "s3://b/sql"),),
        )
    )


def ready(name: str = "llama-0") -> ReadyPod:
    metadata = pod_metadata(name)
    return ReadyPod(
        name, "http://127.0.0.1:1", tcp_address(metadata), served_models(metadata), metadata
    )


@pytest.mark.parametrize(
    ("cards", "pods", "to_zero", "stopping", "present"),
    [
        (True, 0, False, False, True),
        (False, 0, False, False, False),
        (True, 1, False, False, False),
        (True, 0, False, True, False),
        # Marked scaled to zero: in while the last pod still serves, so that the operator can
        # let it go with the activator already ready; never without cards, never stopping.
        (True, 1, True, False, True),
        (True, 0, True, False, True),
        (False, 1, True, False, False),
        (True, 1, True, True, False),
    ],
)
def test_the_rule(cards: bool, pods: int, to_zero: bool, stopping: bool, present: bool) -> None:
    decided = decide(
        cards_ready=cards, ready_pods=pods, scaled_to_zero=to_zero, shutting_down=stopping
    )
    assert decided is present


def test_the_mark_is_the_operators_annotation_on_its_own_slice() -> None:
    # One name on both sides of the contract.
    assert SCALED_TO_ZERO_ANNOTATION == operator_labels.SCALED_TO_ZERO_ANNOTATION
    marked = {"metadata": {"annotations": {SCALED_TO_ZERO_ANNOTATION: "true"}}}
    assert scaled_to_zero(marked)
    assert not scaled_to_zero({"metadata": {"name": "llama-activator"}})
    assert not scaled_to_zero(None)  # its slice not seen (yet)


def test_the_record_is_the_captured_cards_under_the_activators_own_instance() -> None:
    cards = CapturedCards("llama-0", pod_metadata()["model_cards"], {})
    metadata = presence_metadata(cards, CONFIG.pod_name, "10.1.2.3", 9345)
    mine = kubernetes_instance_id(CONFIG.pod_name)
    key = f"dynamo/backend/generate/{mine:x}"
    assert set(metadata["model_cards"]) == {key, key + "/sql_lora"}
    assert {r["instance_id"] for r in metadata["model_cards"].values()} == {mine}
    assert metadata["model_cards"][key + "/sql_lora"]["model_suffix"] == "sql_lora"
    [(endpoint_key, endpoint)] = metadata["endpoints"].items()
    assert endpoint_key == key
    assert endpoint["instance_id"] == mine
    assert endpoint["transport"] == {"tcp": f"10.1.2.3:9345/{mine:x}/dynamo/backend/generate"}
    assert endpoint["request_plane_codec"] == "msgpack"
    assert metadata["event_channels"] == metadata["event_sources"] == {}


def test_the_slice_entry_is_the_activators_pod_and_only_endpoints() -> None:
    applied = slice_apply(CONFIG, ready=True)
    assert applied["metadata"] == {"name": "llama-activator", "namespace": "team-a"}
    assert set(applied) == {"apiVersion", "kind", "metadata", "endpoints"}
    [endpoint] = applied["endpoints"]
    assert endpoint["addresses"] == ["127.0.0.1"]
    assert endpoint["conditions"]["ready"] is True
    assert endpoint["targetRef"] == {
        "kind": "Pod",
        "name": CONFIG.pod_name,
        "namespace": "team-a",
        "uid": "uid-a",
    }
    # Stepped out, the address stays, not ready: the operator's autoscaler reads it there.
    [out] = slice_apply(CONFIG, ready=False)["endpoints"]
    assert out["addresses"] == ["127.0.0.1"]
    assert out["conditions"] == {"ready": False, "serving": False, "terminating": False}


def test_the_view_takes_the_pods_from_the_worker_slices_and_the_mark_from_its_own() -> None:
    def endpoint(pod: str, ip: str) -> dict[str, Any]:
        return {"addresses": [ip], "conditions": {"ready": True}, "targetRef": {"name": pod}}

    slices: dict[str, dict[str, Any]] = {
        "llama-x7k2p": {"metadata": {}, "endpoints": [endpoint("llama-0", "10.0.0.7")]},
        "llama-activator": {
            "metadata": {"annotations": {SCALED_TO_ZERO_ANNOTATION: "true"}},
            "endpoints": [endpoint(CONFIG.pod_name, "10.0.0.9")],
        },
    }
    metadata = {"llama-0": pod_metadata(), CONFIG.pod_name: pod_metadata(CONFIG.pod_name)}
    view = worker_view(slices, metadata, "llama-activator", 8000)
    assert [p.name for p in view.pods] == ["llama-0"]  # never itself
    assert view.scaled_to_zero
    del slices["llama-activator"]["metadata"]["annotations"]
    assert not worker_view(slices, metadata, "llama-activator", 8000).scaled_to_zero


@pytest.fixture
async def activator() -> AsyncIterator[tuple[Activator, MemoryPodSource, MemoryPresence]]:
    source, presence = MemoryPodSource(), MemoryPresence()
    running = Activator(CONFIG, source, presence)
    await running.start()
    yield running, source, presence
    await running.stop()


async def until(condition: Any) -> None:
    """Poll a state the activator's background loop changes (it offers no event for it)."""
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_it_steps_in_at_zero_and_out_when_a_pod_is_ready(
    activator: tuple[Activator, MemoryPodSource, MemoryPresence],
) -> None:
    running, source, presence = activator
    await source.started()
    # Announced (its address, not ready) but, without cards, never present.
    await until(lambda: presence.history == ["out"])
    assert running.metrics.registry.get_sample_value("dynamo_activator_card_ready") == 0
    source.set([ready()])
    await until(lambda: running.cards is not None)
    assert running.metrics.registry.get_sample_value("dynamo_activator_card_ready") == 1
    assert presence.history == ["out"]  # a pod serves: stay out
    source.set([])
    await until(lambda: presence.present)
    assert presence.metadata is not None
    [endpoint] = presence.metadata["endpoints"].values()
    assert endpoint["transport"]["tcp"].startswith(f"127.0.0.1:{running.tcp_port}/")
    source.set([ready("llama-1")])
    await until(lambda: not presence.present)
    assert presence.metadata["endpoints"] == {}
    assert presence.metadata["model_cards"]  # the cards stay, as a draining worker's do
    assert presence.history == ["out", "in", "out"]


async def test_stopping_steps_out(
    activator: tuple[Activator, MemoryPodSource, MemoryPresence],
) -> None:
    running, source, presence = activator
    source.set([ready()])
    await until(lambda: running.cards is not None)
    source.set([])
    await until(lambda: presence.present)
    await running.stop()
    assert not presence.present


async def test_it_steps_in_when_marked_scaled_to_zero_while_a_pod_still_serves(
    activator: tuple[Activator, MemoryPodSource, MemoryPresence],
) -> None:
    running, source, presence = activator
    source.set([ready()])
    await until(lambda: running.cards is not None)
    assert not presence.present
    source.mark_scaled_to_zero(True)
    await until(lambda: presence.present)
    assert presence.metadata is not None
    assert presence.metadata["endpoints"]
    # A request meanwhile goes straight to the pod that still serves: nothing is held.
    pod = await running.hold.wait(running.hold.ticket("llama"))
    assert pod.name == "llama-0"
    assert running.hold.held == 0
    source.set([])  # the last pod goes: still in
    await asyncio.sleep(0.05)
    assert presence.present
    source.mark_scaled_to_zero(False)  # woken: in until a pod is ready
    await asyncio.sleep(0.05)
    assert presence.present
    source.set([ready("llama-1")])
    await until(lambda: not presence.present)
    assert presence.history == ["out", "in", "out"]
