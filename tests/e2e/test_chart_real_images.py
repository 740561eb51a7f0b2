"""The chart end to end on the images users install, on the test bed's kubelet node: the
real kubelet, containerd and runc enforce the chart's securityContext, and nothing here runs
as a host process.

One release, in order: `helm install` of the locally built operator image (two replicas,
one leading); a DynamoWorker on the worker image, its tiny model fetched from the
signature-checking S3 server, becomes Ready; two LoRAAdapters load from that server; a chat
completion answers from the worker Service and through `spec.frontend` on the frontend
image; a worker pod deleted during streams completes them; `kubectl logs` and `exec` work on
every pod.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from support.cluster import Cluster, eventually
from support.images import Images
from support.kubelet_release import (
    GROUP,
    ON_THE_NODE,
    VERSION,
    condition,
    dynamo_worker,
    kubelet_node,
    operator_release,
    s3_credentials,
    state,
)
from support.s3 import TESTBED_HOST, S3Server
from support.s3_sigv4 import sigv4_s3_server
from support.testbed_kubectl import kubectl
from support.testbed_workers import worker_metric
from support.tiny_model import TinyModel
from support.upstream import post_sse

pytestmark = pytest.mark.e2e

WORKER = "tiny"
FRONTEND = f"{WORKER}-frontend"
SERVED = "tiny-llama"
ADAPTERS = ("sql-lora", "poet-lora")
BUCKET = "models"
# A real container start (an image of torch, a model fetched from S3) on 2 shared cores.
READY_WITHIN = 600
STREAM_TOKENS = 300


@pytest.fixture
def models(tiny_model: TinyModel, tmp_path: Path) -> Iterator[S3Server]:
    """The tiny model and its adapters in the signature-checking S3 server, on the test bed's
    host address (pods reach it there)."""
    with sigv4_s3_server(tmp_path / "s3", TESTBED_HOST) as s3:
        s3.client().create_bucket(Bucket=BUCKET)
        s3.upload_dir(BUCKET, "base", tiny_model.base)
        for name, path in tiny_model.adapters.items():
            s3.upload_dir(BUCKET, f"adapters/{name}", path)
        yield s3


async def _ready(api: client.ApiClient, namespace: str) -> bool:
    ready = await condition(api, namespace, WORKER, "Ready")
    return ready is not None and ready["status"] == "True"


async def _adapter_loaded(api: client.ApiClient, namespace: str, name: str) -> bool:
    adapter = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "loraadapters", name
    )
    conditions = (adapter.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def _chat(url: str, model: str) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
        assert answer.status == 200, await answer.text()
        return dict(await answer.json())


async def _service_url(api: client.ApiClient, namespace: str, name: str) -> str:
    service = await client.CoreV1Api(api).read_namespaced_service(name, namespace)
    port = next(p.port for p in service.spec.ports if p.name in ("http", "openai"))
    return f"http://{service.spec.cluster_ip}:{port}/v1/chat/completions"


async def _worker_pods(api: client.ApiClient, namespace: str) -> list[client.V1Pod]:
    listing = await client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"dynamo.dev/worker={WORKER}"
    )
    return [p for p in listing.items if p.metadata.deletion_timestamp is None]


# The first run on a machine imports the images into the node (about 8 GB).
@pytest.mark.timeout(1800)
async def test_the_chart_serves_on_the_real_images(
    api: client.ApiClient, testbed: Cluster, node_images: Images, models: S3Server
) -> None:
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    async with operator_release(testbed, node_images, replicas=2) as release:
        home, watched = release.home, release.watched
        operators = (await core.list_namespaced_pod(home)).items
        assert len(operators) == 2
        assert {p.spec.node_name for p in operators} == {kubelet_node.NODE_NAME}
        # runc runs them as the chart asks: check from inside and from the pod's status.
        for pod in operators:
            uid = kubectl(testbed, "-n", home, "exec", pod.metadata.name, "--", "id", "-u")
            assert uid.stdout.strip() == "10001", uid.stderr
            assert pod.status.container_statuses[0].user.linux.uid == 10001

        s3 = await s3_credentials(api, watched, models)
        spec = {
            "model": {"name": SERVED, "source": f"s3://{BUCKET}/base"},
            "replicas": 2,
            "engine": {"name": "transformers"},
            "resources": {"gpusPerPod": 1, "memory": "2Gi"},
            "lora": {"enabled": True},
            "credentials": {"s3": s3},
            "pod": ON_THE_NODE,
            "frontend": {"image": node_images["frontend"], "pod": ON_THE_NODE},
        }
        await dynamo_worker(api, watched, WORKER, spec)
        try:
            await eventually(lambda: _ready(api, watched), READY_WITHIN, bool)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{state(testbed, home, watched)}") from None

        for name in ADAPTERS:
            adapter = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "LoRAAdapter",
                "metadata": {"name": name},
                "spec": {"workerRef": {"name": WORKER},
                         "source": {"uri": f"s3://{BUCKET}/adapters/{name}"}},
            }  # fmt: skip
            await custom.create_namespaced_custom_object(
                GROUP, VERSION, watched, "loraadapters", adapter
            )
        for name in ADAPTERS:
            await eventually(functools.partial(_adapter_loaded, api, watched, name), 180, bool)

        # The worker pods run as the operator asks, enforced by runc: uid 10001 (from inside
        # and in the pod's status) and a read-only root.
        for pod in await _worker_pods(api, watched):
            assert pod.status.container_statuses[0].user.linux.uid == 10001
            name = pod.metadata.name
            refused = kubectl(testbed, "-n", watched, "exec", name, "--", "touch", "/x")
            assert "Read-only file system" in refused.stderr, (name, refused.stderr)

        # Directly: each worker pod's own OpenAI routes (the worker Service is headless).
        for pod in await _worker_pods(api, watched):
            direct = f"http://{pod.status.pod_ip}:8000/v1/chat/completions"
            assert (await _chat(direct, SERVED))["choices"][0]["message"]["content"]
            for name in ADAPTERS:
                assert (await _chat(direct, name))["model"] == name
        through = await _service_url(api, watched, FRONTEND)
        answered = await eventually(lambda: _chat(through, SERVED), 120, bool)
        assert answered["choices"][0]["message"]["content"]

        # A worker pod deleted during streams: the kubelet sends SIGTERM, the pod drains.
        [victim, *_] = await _worker_pods(api, watched)
        ip = victim.status.pod_ip
        stream = {"model": SERVED, "prompt": "drain me", "max_tokens": STREAM_TOKENS,
                  "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        streams = [
            asyncio.create_task(post_sse(f"http://{ip}:8000/v1/completions", stream))
            for _ in range(3)
        ]
        await eventually(
            lambda: worker_metric(ip, "dynamo_component_inflight_requests"), 60, (3).__eq__
        )
        await core.delete_namespaced_pod(victim.metadata.name, watched)
        for status, events in await asyncio.gather(*streams):
            assert status == 200, events
            assert events[-1] == "[DONE]"
            usage = [e["usage"] for e in events[:-1] if e.get("usage")]
            assert usage[-1]["completion_tokens"] == STREAM_TOKENS, events[-3:]

        # Logs and exec through the API server and the real kubelet, on every pod.
        for namespace in (home, watched):
            for pod in (await core.list_namespaced_pod(namespace)).items:
                if pod.metadata.deletion_timestamp is not None:
                    continue
                name = pod.metadata.name
                logs = kubectl(testbed, "-n", namespace, "logs", name, "--tail=5")
                assert logs.returncode == 0, logs.stderr
                done = kubectl(testbed, "-n", namespace, "exec", name, "--", "id", "-u")
                assert done.stdout.strip() == "10001", (name, done.stderr)
