"""LoRAAdapter `requiredForReadiness` end to end: the operator (a subprocess) adds the
readiness gate `dynamo.dev/lora-adapters-ready` to a DynamoWorker's pods while a required
adapter targets it, and sets the condition per pod once the adapter is loaded there. Worker
pods (SampleEngine) run on the process node, which honours readiness gates as the kubelet does.

Steps, in order: a required adapter that cannot load holds the new (gated) pods back while
the old ones keep serving; fixing its source lets them load it, turn Ready and finish the
rollout; deleting it removes the gate again.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from support.cluster import Cluster
from support.operator_namespace import (
    GROUP,
    MERGE,
    VERSION,
    OperatorNamespace,
    operator_namespace,
    serving_worker_spec,
)
from support.tiny_model import TinyModel

pytestmark = pytest.mark.e2e

WORKER = "gated"
ADAPTER = "must-have"
GATE = "dynamo.dev/lora-adapters-ready"


class Bed(OperatorNamespace):
    """The namespace, with this module's questions about its worker and adapter."""

    async def pods(self) -> list[Any]:
        listing = await self.core.list_namespaced_pod(
            self.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
        )
        return [p for p in listing.items if p.metadata.deletion_timestamp is None]

    async def adapter(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters", ADAPTER
        )
        return found

    async def worker(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "dynamoworkers", WORKER
        )
        return found


def conditions(pod: Any) -> dict[str, str]:
    return {c.type: c.status for c in pod.status.conditions or []}


def gated(pod: Any) -> bool:
    return any(g.condition_type == GATE for g in pod.spec.readiness_gates or [])


def ready(pod: Any) -> bool:
    return conditions(pod).get("Ready") == "True"


def worker_ready(obj: dict[str, Any]) -> dict[str, Any]:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition["type"] == "Ready":
            return dict(condition)
    return {}


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    log_dir = tmp_path_factory.mktemp("gate-operator")
    async with operator_namespace(api, testbed, "t-gate", log_dir) as space:
        shutil.copytree(tiny_model.base, space.shared / "base")
        shutil.copytree(tiny_model.adapters["sql-lora"], space.shared / "sql-lora")
        bed = Bed(**vars(space))
        worker: Any = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DynamoWorker",
            "metadata": {"name": WORKER},
            "spec": serving_worker_spec(space.shared / "base"),
        }
        await space.create("dynamoworkers", worker)
        await bed.eventually(
            "2 ready pods", bed.pods, 120, lambda ps: len(ps) == 2 and all(map(ready, ps))
        )
        yield bed


async def test_a_required_adapter_that_cannot_load_holds_new_pods_back(bed: Bed) -> None:
    body: Any = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LoRAAdapter",
        "metadata": {"name": ADAPTER},
        "spec": {
            "workerRef": {"name": WORKER},
            "source": {"uri": (bed.shared / "no-such-adapter").as_uri()},
            "requiredForReadiness": True,
        },
    }
    await bed.create("loraadapters", body)

    def held_back(pods: list[Any]) -> bool:
        new = [p for p in pods if gated(p)]
        old = [p for p in pods if not gated(p)]
        return (
            len(new) >= 1
            and all(conditions(p).get("ContainersReady") == "True" for p in new)
            and all(conditions(p).get(GATE) == "False" and not ready(p) for p in new)
            and len(old) == 2
            and all(map(ready, old))
        )

    # The gate rolls the pods (surge one); the new pod's containers are ready but the
    # adapter cannot load, so it stays unready while the two old pods keep serving.
    pods = await bed.eventually("a held-back gated pod", bed.pods, 90, held_back)
    worker = await bed.worker()
    assert worker["status"]["readyReplicas"] == 2
    # The controller tries the gated pod too (its containers are ready), and fails there.
    new = {p.metadata.name for p in pods if gated(p)}

    def tried_everywhere(adapter: dict[str, Any]) -> bool:
        states = {p["pod"]: p["state"] for p in (adapter.get("status") or {}).get("pods", [])}
        return all(states.get(name) == "Failed" for name in new)

    await bed.eventually("failed on the gated pod", bed.adapter, 60, tried_everywhere)
    assert all(not ready(p) for p in await bed.pods() if p.metadata.name in new)


async def test_loading_the_adapter_lets_the_gated_pods_serve(bed: Bed) -> None:
    uri = (bed.shared / "sql-lora").as_uri()
    await bed.custom.patch_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, "loraadapters", ADAPTER,
        {"spec": {"source": {"uri": uri}}}, **MERGE,
    )  # fmt: skip

    def rolled(pods: list[Any]) -> bool:
        return len(pods) == 2 and all(gated(p) and ready(p) for p in pods)

    pods = await bed.eventually("2 gated ready pods", bed.pods, 120, rolled)
    assert all(conditions(p)[GATE] == "True" for p in pods)
    adapter = await bed.adapter()
    loaded = {p["pod"] for p in adapter["status"]["pods"] if p["state"] == "Loaded"}
    assert {p.metadata.name for p in pods} <= loaded
    # The old pod, draining, still counts as ready until it is gone.
    await bed.eventually(
        "DynamoWorker Ready with its 2 pods",
        bed.worker,
        60,
        lambda w: worker_ready(w).get("status") == "True" and w["status"]["readyReplicas"] == 2,
    )


async def test_deleting_the_required_adapter_removes_the_gate(bed: Bed) -> None:
    await bed.custom.delete_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, "loraadapters", ADAPTER
    )

    def ungated(pods: list[Any]) -> bool:
        return len(pods) == 2 and all(not gated(p) and ready(p) for p in pods)

    await bed.eventually("2 ungated ready pods", bed.pods, 120, ungated)
