"""The autoscaler end to end on the test bed: the operator (a subprocess) and worker pods on
the process node serving the tiny model with the sample engine (50 ms a token, so a stream
lasts long enough to be load), driven by a real OpenAI client (the `openai` package).

- Load scales out: 6 concurrent streams against a target of 2 in flight per pod take the
  worker from 1 to 3 pods, with the decision in status, an Event and the operator's metrics.
- Scale-down under streams loses none: with 2 streams left, the count goes back to 1 after
  the scale-down window; the pods that go are the idle ones (pod-deletion-cost), and the
  drain finishes what they serve. Every stream completes.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from dynamo_operator.reconcile.dynamoworker.autoscaler import DELETION_COST
from support.cluster import Cluster
from support.operator_namespace import OperatorNamespace, operator_namespace, serving_worker_spec
from support.tiny_model import TinyModel
from support.upstream import SAMPLE_ENGINE

pytestmark = pytest.mark.e2e

WORKER = "elastic"
SERVED = "tiny-llama"
AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "targetInFlightPerPod": 2,
    "scaleDownWindowSeconds": 10,
}


class Bed(OperatorNamespace):
    async def worker(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            "dynamo.dev", "v1alpha1", self.namespace, "dynamoworkers", WORKER
        )
        return found

    async def ready_pod_ips(self) -> list[str]:
        listing = await self.core.list_namespaced_pod(
            self.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
        )
        return sorted(
            p.status.pod_ip
            for p in listing.items
            if p.status.pod_ip
            and p.metadata.deletion_timestamp is None
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        )


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    log_dir = tmp_path_factory.mktemp("autoscaling-operator")
    async with operator_namespace(api, testbed, "t-as", log_dir) as space:
        shutil.copytree(tiny_model.base, space.shared / "base")
        spec = serving_worker_spec(space.shared / "base", replicas=1, engine=SAMPLE_ENGINE)
        spec["engine"]["extraArgs"] = ["--token-delay", "0.05"]
        spec["drain"] = {"gracePeriodSeconds": 1, "drainTimeoutSeconds": 30}
        spec["autoscaling"] = AUTOSCALING
        body = {
            "apiVersion": "dynamo.dev/v1alpha1",
            "kind": "DynamoWorker",
            "metadata": {"name": WORKER},
            "spec": spec,
        }
        await space.create("dynamoworkers", body)
        yield Bed(**vars(space))


async def stream(ip: str, max_tokens: int) -> tuple[int | None, str | None]:
    """One streamed chat completion with the OpenAI client: (completion tokens, finish)."""
    async with openai.AsyncOpenAI(
        base_url=f"http://{ip}:8000/v1", api_key="none", max_retries=0, timeout=120
    ) as oai:
        tokens, finish = None, None
        answer = await oai.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": "count for me"}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in answer:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, finish


async def test_load_scales_out_and_scale_down_loses_no_stream(bed: Bed) -> None:
    await bed.eventually("one ready pod", bed.ready_pod_ips, 180, lambda ips: len(ips) == 1)
    [ip] = await bed.ready_pod_ips()
    # 6 streams of ~10 s on the one pod: 6 in flight against 2 per pod asks for 3 pods.
    load = [asyncio.create_task(stream(ip, 200)) for _ in range(6)]
    worker = await bed.eventually(
        "scaled out to 3",
        bed.worker,
        60,
        # The count first, then the reconcile it wakes writes the decision to status.
        lambda w: (
            w["spec"]["replicas"] == 3
            and "lastDecision" in ((w.get("status") or {}).get("autoscaling") or {})
        ),
    )
    decision = worker["status"]["autoscaling"]["lastDecision"]
    assert decision["direction"] == "Up", decision
    assert "target 2 per pod" in decision["reason"]
    events = await bed.core.list_namespaced_event(
        bed.namespace, field_selector=f"involvedObject.name={WORKER}"
    )
    assert any(e.reason == "ScaledUp" and "1 -> 3" in e.message for e in events.items)
    exported = {
        (name, dict(labels).get("signal")): value
        for (name, labels), value in bed.operator.metrics().items()
        if dict(labels).get("name") == WORKER
    }
    assert exported[("dynamo_operator_autoscaler_desired_replicas", None)] == 3
    assert ("dynamo_operator_autoscaler_load", "in_flight") in exported
    ips = await bed.eventually("3 ready pods", bed.ready_pod_ips, 120, lambda i: len(i) == 3)
    for chunks, finish in await asyncio.gather(*load):
        assert (chunks, finish) == (200, "length")

    # 2 long streams on one pod: the other two are idle, the count goes to 1 after the
    # 10 s window, and the idle pods are the ones removed.
    busy = ips[0]
    held = [asyncio.create_task(stream(busy, 500)) for _ in range(2)]
    await bed.eventually("scaled down to 1", bed.worker, 90, lambda w: w["spec"]["replicas"] == 1)
    listing = await bed.core.list_namespaced_pod(
        bed.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
    )
    costs = {
        p.status.pod_ip: (p.metadata.annotations or {}).get(DELETION_COST) for p in listing.items
    }
    assert costs.get(busy) == "2", costs
    remaining = await bed.eventually("one pod left", bed.ready_pod_ips, 120, lambda i: len(i) == 1)
    assert remaining == [busy]
    for chunks, finish in await asyncio.gather(*held):
        assert (chunks, finish) == (500, "length")
