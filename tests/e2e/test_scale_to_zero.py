"""Scale to zero end to end on the test bed: the operator (a subprocess), worker pods and the
activator on the process node, upstream Dynamo 1.6.1's frontend (hack/oracle-venv) under
Kubernetes discovery, and a real OpenAI client (the `openai` package).

In order, on one DynamoWorker (minReplicas 0, scale to zero after 10 s idle):

1. Idle, it goes to zero (ScaledToZero); the model stays listed, both by upstream's frontend
   and by the worker Service (whose only ready endpoint is then the activator).
2. A streamed request sent to the Service at zero is held, wakes the worker (WokenFromZero),
   and is answered with exactly the tokens a pod gave before.
3. The same through upstream's frontend: held at the activator over the TCP request plane,
   answered.
4. A LoRA adapter's request at zero is held until the new pod has loaded the adapter.
5. A request for an adapter that never loads ends after holdTimeoutSeconds with 503,
   Retry-After and a body naming the DynamoWorker and the adapter.
6. The activator killed while it holds a request: the client gets an error at once, not a
   hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from openai.types.chat import ChatCompletionMessageParam

from support.cluster import Cluster
from support.operator_namespace import (
    GROUP,
    ON_PROCESS_NODE,
    VERSION,
    OperatorNamespace,
    operator_namespace,
    serving_worker_spec,
)
from support.testbed_workers import service_addresses
from support.tiny_model import TinyModel
from support.upstream import listed_models, upstream_python

pytestmark = pytest.mark.e2e

WORKER = "sleepy"
SERVED = "tiny-llama"
ADAPTER = "sql-lora"
HOLD_TIMEOUT = 15
AUTOSCALING = {
    "minReplicas": 0,
    "maxReplicas": 2,
    "targetInFlightPerPod": 2,
    "scaleDownWindowSeconds": 5,
    "scaleToZeroAfterSeconds": 10,
    "holdTimeoutSeconds": HOLD_TIMEOUT,
    "activatorPod": ON_PROCESS_NODE,
}
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "wake up"}]


class Bed(OperatorNamespace):
    async def worker(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "dynamoworkers", WORKER
        )
        return found

    async def pods(self, selector: str) -> list[Any]:
        listing = await self.core.list_namespaced_pod(self.namespace, label_selector=selector)
        return [p for p in listing.items if p.metadata.deletion_timestamp is None]

    async def worker_pods(self) -> list[Any]:
        return await self.pods(f"dynamo.dev/worker={WORKER}")

    async def service_addresses(self) -> list[str]:
        return await service_addresses(self.api, self.namespace, WORKER)

    async def activator_metric(self, name: str) -> float:
        [pod] = await self.pods(f"dynamo.dev/activator={WORKER}")
        url = f"http://{pod.status.pod_ip}:9090/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    async def at_zero(self) -> bool:
        """No worker pod, and the activator stands in: the Service's one ready address is its.
        (Any ready address is not enough: the EndpointSlice controller drops a deleted pod's
        address a moment after the pod is gone, before the activator steps in.)"""
        worker = await self.worker()
        if worker["spec"]["replicas"] != 0 or await self.worker_pods():
            return False
        activators = await self.pods(f"dynamo.dev/activator={WORKER}")
        ips = [pod.status.pod_ip for pod in activators if pod.status.pod_ip]
        return len(ips) == 1 and await self.service_addresses() == ips

    async def reasons(self) -> list[str]:
        listed = await self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={WORKER}"
        )
        return [e.reason for e in listed.items]


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    python = upstream_python()
    log_dir = tmp_path_factory.mktemp("scale-to-zero-operator")
    async with operator_namespace(api, testbed, "t-zero", log_dir) as space:
        shutil.copytree(tiny_model.base, space.shared / "base")
        shutil.copytree(tiny_model.adapters[ADAPTER], space.shared / ADAPTER)
        spec = serving_worker_spec(space.shared / "base", replicas=1)
        spec["autoscaling"] = AUTOSCALING
        spec["frontend"] = {
            "image": "nvcr.io/nvidia/ai-dynamo/vllm-runtime:1.6.1",
            "command": [str(python), "-m", "dynamo.frontend"],
            "pod": ON_PROCESS_NODE,
        }
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DynamoWorker",
            "metadata": {"name": WORKER},
            "spec": spec,
        }
        await space.create("dynamoworkers", body)
        yield Bed(**vars(space))


async def chat(base: str, model: str = SERVED) -> tuple[str, str | None]:
    """A streamed greedy chat completion: (the text, the finish reason)."""
    async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=120) as oai:
        answer = await oai.chat.completions.create(
            model=model,
            messages=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text, finish = "", None
        async for chunk in answer:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish


async def frontend_base(bed: Bed) -> str:
    service = await bed.core.read_namespaced_service(f"{WORKER}-frontend", bed.namespace)
    return f"http://{service.spec.cluster_ip}:8000/v1"


async def longest_unlisted(base: str, done: asyncio.Event) -> float:
    """Reads the model list at `base` every 0.1 s until `done`; the longest stretch of seconds
    in which it lacked the served model."""
    longest, since = 0.0, None
    while not done.is_set():
        try:
            listed = SERVED in await listed_models(base)
        except aiohttp.ClientError:
            listed = False
        now = time.monotonic()
        if not listed and since is None:
            since = now
        elif listed and since is not None:
            longest, since = max(longest, now - since), None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.1)
    return longest if since is None else max(longest, time.monotonic() - since)


async def listed_at_zero(bed: Bed, frontend: str) -> None:
    """Until upstream's frontend lists the model again, the activator's card now."""
    await bed.eventually(
        "listed by the frontend at zero",
        lambda: listed_models(frontend),
        30,
        lambda ids: SERVED in ids,
    )


REFERENCE: dict[str, tuple[str, str | None]] = {}


async def test_idle_goes_to_zero_and_the_model_stays_listed(bed: Bed) -> None:
    pods = await bed.eventually("a ready pod", bed.service_addresses, 180, lambda a: len(a) == 1)
    [pod_ip] = pods
    REFERENCE[SERVED] = await chat(f"http://{pod_ip}:8000/v1")
    assert REFERENCE[SERVED][0]
    adapter = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LoRAAdapter",
        "metadata": {"name": ADAPTER},
        "spec": {"workerRef": {"name": WORKER}, "source": {"uri": (bed.shared / ADAPTER).as_uri()}},
    }
    await bed.create("loraadapters", adapter)
    await bed.eventually(
        "the adapter served",
        lambda: listed_models(f"http://{pod_ip}:8000/v1"),
        60,
        lambda ids: ADAPTER in ids,
    )
    REFERENCE[ADAPTER] = await chat(f"http://{pod_ip}:8000/v1", ADAPTER)
    frontend = await frontend_base(bed)
    await bed.eventually(
        "listed by the frontend", lambda: listed_models(frontend), 120, lambda ids: SERVED in ids
    )
    # Upstream's frontend tokenizes and detokenizes itself: its own answer is the reference.
    REFERENCE["frontend"] = await chat(frontend)
    await bed.eventually(
        "the activator holds the card",
        lambda: bed.activator_metric("dynamo_activator_card_ready"),
        60,
        (1.0).__eq__,
    )
    # How long upstream's frontend goes without the model while the pod hands over to the
    # activator (printed: the activator steps in once the last pod has left, see the guide).
    done = asyncio.Event()
    watching = asyncio.create_task(longest_unlisted(frontend, done))
    try:
        await bed.eventually("at zero", bed.at_zero, 120, bool)
        await listed_at_zero(bed, frontend)
    finally:
        done.set()  # the event loop outlives this test: the poller must not
    print(f"\n[scale-to-zero] the frontend lacked the model for {await watching:.1f} s at most")
    assert "ScaledToZero" in await bed.reasons()
    worker = await bed.worker()
    assert worker["status"]["autoscaling"]["lastDecision"]["direction"] == "ToZero"
    ready = next(c for c in worker["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ScaledToZero"
    # The Service's one ready address is now the activator's; it lists the model and adapter.
    [activator] = await bed.pods(f"dynamo.dev/activator={WORKER}")
    addresses = await bed.eventually(
        "the activator stands in", bed.service_addresses, 30, lambda a: len(a) == 1
    )
    assert addresses == [activator.status.pod_ip]
    listed = await listed_models(f"http://{addresses[0]}:8000/v1")
    assert SERVED in listed


async def test_a_request_at_zero_through_the_service_is_held_and_answered(bed: Bed) -> None:
    assert await bed.at_zero()
    [activator_ip] = await bed.service_addresses()
    started = time.monotonic()
    answer = await chat(f"http://{activator_ip}:8000/v1")
    waited = time.monotonic() - started
    assert answer == REFERENCE[SERVED]
    assert "WokenFromZero" in await bed.reasons()
    assert await bed.activator_metric("dynamo_activator_forwarded_total") >= 1
    print(f"\n[scale-to-zero] a request at zero answered after {waited:.1f} s")


async def test_a_request_at_zero_through_upstreams_frontend(bed: Bed) -> None:
    await bed.eventually("back at zero", bed.at_zero, 120, bool)
    frontend = await frontend_base(bed)
    await listed_at_zero(bed, frontend)
    # The activator stood in before the last pod went (the operator holds the pod until its
    # endpoint is ready), so the frontend routes to it at once; it would answer 503 only had
    # one of its watches seen the pod leave before the other saw the activator arrive (see
    # the guide's limits). A client that retries a 503 is served; the count is printed.
    deadline, refused = time.monotonic() + 30, 0
    while True:
        try:
            answer = await chat(frontend)
            break
        except openai.InternalServerError as err:
            if err.status_code != 503 or time.monotonic() > deadline:
                raise
            refused += 1
            await asyncio.sleep(0.5)  # the client's pause before it retries
    assert answer == REFERENCE["frontend"]
    print(f"\n[scale-to-zero] through the frontend at zero: answered after {refused} 503(s)")


async def test_an_adapter_request_at_zero_waits_for_its_adapter(bed: Bed) -> None:
    await bed.eventually("back at zero", bed.at_zero, 120, bool)
    [activator_ip] = await bed.service_addresses()
    assert await chat(f"http://{activator_ip}:8000/v1", ADAPTER) == REFERENCE[ADAPTER]


async def test_a_request_whose_adapter_never_loads_ends_503(bed: Bed) -> None:
    await bed.eventually("back at zero", bed.at_zero, 120, bool)
    [activator_ip] = await bed.service_addresses()
    body = {"model": "no-such-adapter", "messages": PROMPT, "max_tokens": 4}
    started = time.monotonic()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{activator_ip}:8000/v1/chat/completions", json=body) as response,
    ):
        answer = await response.json(content_type=None)
        assert response.status == 503, answer
        assert int(response.headers["Retry-After"]) > 0
    assert time.monotonic() - started >= HOLD_TIMEOUT - 1
    message = answer["error"]["message"]
    assert f"{bed.namespace}/{WORKER}" in message
    assert "no-such-adapter" in message
    assert await bed.activator_metric("dynamo_activator_expired_total") >= 1


async def test_a_killed_activator_fails_its_held_requests_at_once(bed: Bed) -> None:
    await bed.eventually("back at zero", bed.at_zero, 180, bool)
    [activator_ip] = await bed.service_addresses()
    [activator] = await bed.pods(f"dynamo.dev/activator={WORKER}")
    held = asyncio.create_task(chat(f"http://{activator_ip}:8000/v1", "no-such-adapter"))
    await bed.eventually(
        "held", lambda: bed.activator_metric("dynamo_activator_held_requests"), 30, bool
    )
    killed = time.monotonic()
    await bed.core.delete_namespaced_pod(
        activator.metadata.name, bed.namespace, grace_period_seconds=0
    )
    with pytest.raises(openai.APIError):
        await asyncio.wait_for(held, 30)
    assert time.monotonic() - killed < 15
    # A new activator comes up in its place.
    await bed.eventually(
        "a new activator",
        lambda: bed.pods(f"dynamo.dev/activator={WORKER}"),
        60,
        lambda pods: any(p.metadata.uid != activator.metadata.uid for p in pods),
    )
