"""A DynamoWorker with the vLLM engine on the test bed: the operator (a subprocess) runs two
worker pods of `dynamo-worker --engine vllm` on the process node (the image
`dynamo-worker-vllm:testbed` runs in vLLM's venv, `hack/vllm-venv`), serving the head_dim-64
tiny Llama on the CPU, with upstream Dynamo's frontend (1.6.1, `hack/oracle-venv`) in front
in KV-routing mode.

One DynamoWorker serves every step (each vLLM start costs about a minute of both cores), in
order: it becomes Ready with the flags the spec implies (--tensor-parallel-size from
gpusPerPod, --max-model-len from the token budget) and vLLM's own metrics; two LoRAAdapters
from the S3 server load onto both pods and each changes the output; the frontend routes
prompts by the KV events vLLM published; a pod deleted (SIGTERM) during 5 streams finishes
all 5. Skipped without vLLM's or upstream's venv.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from support import vllm
from support.cluster import REPO, Cluster
from support.operator_namespace import (
    GROUP,
    ON_PROCESS_NODE,
    VERSION,
    OperatorNamespace,
    operator_namespace,
)
from support.s3 import S3Server, testbed_s3_server
from support.testbed_workers import (
    delete_while_in_flight,
    engine_frozen,
    kv_event_endpoints,
    kv_routes,
    wait_kv_subscriptions,
    worker_pods,
)
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import assert_stream_completed, post_sse, upstream_python

sys.path.insert(0, str(REPO / "hack"))
from testbed.layout import VLLM_WORKER_IMAGE

pytestmark = pytest.mark.e2e
__all__ = ["testbed_s3_server"]

WORKER = "tiny-vllm"
SERVED = "tiny-llama"
FRONTEND = f"{WORKER}-frontend"
FRONTEND_IMAGE = "nvcr.io/nvidia/ai-dynamo/vllm-runtime:1.6.1"
# KV blocks of 32 tokens (vLLM's CPU default is 128): short prompts fill whole blocks.
BLOCK = 32
PROMPT = "the quick brown"
DRAIN_TOKENS = 400


@dataclass
class Bed(OperatorNamespace):
    """The namespace and its operator, the adapters' S3 URIs by name, and this module's
    questions about its worker."""

    adapters: dict[str, str] = field(default_factory=dict)

    async def worker(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "dynamoworkers", WORKER
        )
        return found

    async def adapter(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters", name
        )
        return found

    async def pod_ips(self) -> list[str]:
        return sorted(p.status.pod_ip for p in await worker_pods(self, WORKER))


def ready(obj: dict[str, Any]) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def completion(ip: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{ip}:8000/v1/completions", json=body) as response,
    ):
        answer = await response.json(content_type=None)
        assert response.status == 200, answer
    return str(answer["choices"][0]["text"])


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    testbed_s3_server: S3Server,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    vllm.vllm_python_or_skip()
    frontend_python = upstream_python()
    log_dir = tmp_path_factory.mktemp("vllm-operator")
    async with operator_namespace(api, testbed, "t-vllm", log_dir) as space:
        model = space.shared / "model"
        generator = load_generator()
        await asyncio.to_thread(generator.write_tiny_model, model, TINY_MODEL_SEED, 64)
        s3 = testbed_s3_server
        bucket = s3.new_bucket("vllm-lora")
        for spec in generator.ADAPTERS:
            s3.upload_dir(bucket, spec.name, model / "adapters" / spec.name)
        secret: Any = {
            "metadata": {"name": "s3-creds"},
            "data": {
                "AWS_ACCESS_KEY_ID": base64.b64encode(b"testing").decode(),
                "AWS_SECRET_ACCESS_KEY": base64.b64encode(b"testing").decode(),
            },
        }
        await space.core.create_namespaced_secret(space.namespace, secret)
        worker: Any = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DynamoWorker",
            "metadata": {"name": WORKER},
            "spec": {
                "model": {"name": SERVED, "source": str(model / "base")},
                # The process node runs this image's command in vLLM's venv.
                "image": VLLM_WORKER_IMAGE,
                "replicas": 2,
                "engine": {
                    "name": "vllm",
                    "extraArgs": [*vllm.CPU_EXTRA_ARGS, "--block-size", str(BLOCK)],
                },
                # One GPU each (the process node advertises 8): tensor parallelism 1.
                "resources": {"gpusPerPod": 1},
                "tokenBudget": {"combinedLimit": vllm.CPU_CONTEXT},
                "lora": {"enabled": True, "maxLoras": len(generator.ADAPTERS)},
                "drain": {"gracePeriodSeconds": 1, "drainTimeoutSeconds": 60},
                "credentials": {
                    "s3": {
                        "secretName": "s3-creds",
                        "endpoint": s3.endpoint_url,
                        "region": "us-east-1",
                    }
                },
                "pod": {**ON_PROCESS_NODE, "env": vllm.pod_env({})},
                "frontend": {
                    "image": FRONTEND_IMAGE,
                    "command": [str(frontend_python), "-m", "dynamo.frontend"],
                    "routerMode": "kv",
                    "pod": ON_PROCESS_NODE,
                },
            },
        }
        await space.create("dynamoworkers", worker)
        yield Bed(
            **vars(space),
            adapters={spec.name: f"s3://{bucket}/{spec.name}" for spec in generator.ADAPTERS},
        )


async def test_worker_becomes_ready_serving_with_vllm(bed: Bed) -> None:
    # Two vLLM starts share the machine's cores: a few minutes.
    found = await bed.eventually("Ready", bed.worker, 600, ready)
    assert found["status"]["readyReplicas"] == 2
    pods = await worker_pods(bed, WORKER)
    for pod in pods:
        args = pod.spec.containers[0].args
        assert args[args.index("--engine") + 1] == "vllm"
        engine_args = args[args.index("--") + 1 :]
        assert engine_args[:4] == ["--tensor-parallel-size", "1", "--max-model-len", "512"]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://{pod.status.pod_ip}:9090/metrics") as response,
        ):
            families = {f.name for f in text_string_to_metric_families(await response.text())}
        assert any(name.startswith("vllm:") for name in families), sorted(families)
    # The budget each pod published is vLLM's context, which the spec set.
    budgets = [p["tokenBudget"]["combinedLimit"] for p in found["status"]["pods"]]
    assert budgets == [vllm.CPU_CONTEXT] * 2


async def test_adapters_from_s3_load_on_both_pods_and_change_the_output(bed: Bed) -> None:
    for name, uri in bed.adapters.items():
        body: Any = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "LoRAAdapter",
            "metadata": {"name": name},
            "spec": {"workerRef": {"name": WORKER}, "source": {"uri": uri}},
        }
        await bed.create("loraadapters", body)
    for name in bed.adapters:
        found = await bed.eventually(
            f"LoRAAdapter {name} loaded on 2 pods",
            functools.partial(bed.adapter, name),
            120,
            lambda a: ready(a) and a["status"].get("loaded") == "2/2",
        )
        assert {p["state"] for p in found["status"]["pods"]} == {"Loaded"}
    ips = await bed.pod_ips()
    texts = {ip: {m: await completion(ip, m) for m in (SERVED, *bed.adapters)} for ip in ips}
    # Greedy decoding: both pods answer alike, and each adapter changes the base's text.
    assert texts[ips[0]] == texts[ips[1]], texts
    for name in bed.adapters:
        assert texts[ips[0]][name] != texts[ips[0]][SERVED], texts


async def test_the_frontend_routes_by_vllms_kv_events(bed: Bed, testbed: Cluster) -> None:
    listing = await bed.core.list_namespaced_pod(
        bed.namespace, label_selector=f"dynamo.dev/frontend={WORKER}"
    )
    [frontend] = listing.items
    endpoints = await bed.eventually(
        "kv-events channels", lambda: kv_event_endpoints(bed, WORKER), 30, lambda e: len(e) == 2
    )
    await wait_kv_subscriptions(bed, testbed, frontend, endpoints)
    service = await bed.core.read_namespaced_service(FRONTEND, bed.namespace)
    url = f"http://{service.spec.cluster_ip}:8000/v1/completions"
    # Two full blocks per prompt, different per pod and per prompt.
    prompts = {
        ip: [
            [(100 + 50 * index + 7 * n + j) % 400 + 10 for j in range(2 * BLOCK)] for n in range(2)
        ]
        for index, ip in enumerate(await bed.pod_ips())
    }
    routed = await kv_routes(url, SERVED, prompts)
    # Random placement would get all four right one time in 16.
    assert routed == [(ip, [ip]) for ip in prompts for _ in range(2)], routed


async def test_sigterm_during_five_streams_completes_all_five(bed: Bed) -> None:
    [victim, *_] = await worker_pods(bed, WORKER)
    ip = victim.status.pod_ip
    body = {
        "model": SERVED,
        "prompt": "drain me",
        "max_tokens": DRAIN_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # The engine is frozen until the worker is draining the 5 streams: they are then in
    # flight when the SIGTERM comes, however fast the engine decodes.
    with engine_frozen(victim):
        streams = [
            asyncio.create_task(post_sse(f"http://{ip}:8000/v1/completions", body))
            for _ in range(5)
        ]
        try:
            await delete_while_in_flight(bed, victim, 5)
        except AssertionError as err:
            # What the streams that already ended got (a refusal, a broken connection).
            ended = [repr(s.exception() or s.result())[:300] for s in streams if s.done()]
            raise AssertionError(f"{err}\nstreams ended: {ended}") from None
    assert not any(stream.done() for stream in streams)
    for status, events in await asyncio.gather(*streams):
        assert_stream_completed(status, events, DRAIN_TOKENS)

    # The pod drained and exited: the process node finalized it.
    async def names() -> set[str]:
        listing = await bed.core.list_namespaced_pod(
            bed.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
        )
        return {p.metadata.name for p in listing.items}

    await bed.eventually("the drained pod gone", names, 90, lambda n: victim.metadata.name not in n)
