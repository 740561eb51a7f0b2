"""End to end with the reference engine: a real `dynamo-worker` running the tiny Llama
checkpoint (TransformersEngine, CPU), loading a PEFT adapter from the loopback S3 server, and
publishing its DynamoWorkerMetadata to the test bed's API server as a worker pod would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from support.cluster import REPO, Cluster, ensure_crd, eventually
from support.s3 import S3Server
from support.tiny_model import TinyModel
from support.upstream import post_json
from support.worker_process import WorkerFactory, worker_factory

pytestmark = pytest.mark.e2e
__all__ = ["worker_factory"]

ENGINE = "dynamo.engines.transformers_engine:TransformersEngine"
DWM = ("nvidia.com", "v1alpha1", "dynamoworkermetadatas")


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.json(content_type=None)


def upload_adapter(s3: S3Server, adapter_dir: Path) -> str:
    """Put a PEFT adapter directory into a fresh bucket; its s3:// URI."""
    bucket = s3.new_bucket("tiny")
    s3_client = s3.client()
    for path in adapter_dir.rglob("*"):
        if path.is_file():
            key = f"adapters/{adapter_dir.name}/{path.relative_to(adapter_dir).as_posix()}"
            s3_client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    return f"s3://{bucket}/adapters/{adapter_dir.name}"


async def completion(http: str, model: str, prompt: str = "the quick brown") -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, answer = await post_json(http + "/v1/completions", body)
    assert status == 200, answer
    return str(answer["choices"][0]["text"])


async def test_tiny_model_serves_greedy_text_and_an_s3_adapter(
    worker_factory: WorkerFactory, tiny_model: TinyModel, s3_server: S3Server, tmp_path: Path
) -> None:
    adapter = next(iter(tiny_model.adapters.values()))
    uri = upload_adapter(s3_server, adapter)
    env = {
        **s3_server.env,
        "AWS_ALLOW_HTTP": "true",
        "DYN_LORA_ENABLED": "true",
        "DYN_LORA_PATH": str(tmp_path / "cache"),
    }
    worker = worker_factory(
        "--engine", ENGINE, "--model", str(tiny_model.base), "--max-loras", "2", env=env
    )
    await worker.wait_health(200, within=120)
    system, http = worker.system_url(), worker.http_url()
    served = (await get_json(http + "/v1/models"))["data"][0]

    base = await completion(http, served["id"])
    assert base == await completion(http, served["id"]), "greedy decoding is deterministic"

    status, loaded = await post_json(
        system + "/v1/loras", {"lora_name": "tiny-adapter", "source": {"uri": uri}}
    )
    assert status == 200, loaded
    models = [m["id"] for m in (await get_json(http + "/v1/models"))["data"]]
    assert models == [served["id"], "tiny-adapter"]
    adapted = await completion(http, "tiny-adapter")
    assert adapted != base, "the adapter's non-zero LoRA weights change greedy output"
    assert await completion(http, served["id"]) == base, "the base is unaffected"

    chat = {
        "model": "tiny-adapter",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    status, answer = await post_json(http + "/v1/chat/completions", chat)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] <= 4
    worker.terminate()
    assert await worker.wait_exit() == 0


async def test_worker_publishes_its_dynamoworkermetadata(
    worker_factory: WorkerFactory,
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    s3_server: S3Server,
    tiny_model: TinyModel,
    tmp_path: Path,
) -> None:
    """With a pod's env (POD_*, kubernetes discovery), the worker server-side-applies its
    DynamoWorkerMetadata owned by the Pod, and updates it on adapter loads and taint changes."""
    await ensure_crd(api, REPO / "crds" / "nvidia.com_dynamoworkermetadatas.yaml")
    pod_body: Any = {
        "metadata": {"name": "tiny-worker-0"},
        "spec": {
            "nodeSelector": {"type": "kwok"},
            "containers": [{"name": "main", "image": "example.invalid/worker:1"}],
        },
    }
    pod = await client.CoreV1Api(api).create_namespaced_pod(namespace, pod_body)
    uri = upload_adapter(s3_server, next(iter(tiny_model.adapters.values())))
    env = {
        **s3_server.env,
        "AWS_ALLOW_HTTP": "true",
        "DYN_LORA_ENABLED": "true",
        "DYN_LORA_PATH": str(tmp_path / "cache"),
        "DYN_DISCOVERY_BACKEND": "kubernetes",
        "KUBECONFIG": str(cluster.kubeconfig),
        "POD_NAME": pod.metadata.name,
        "POD_NAMESPACE": namespace,
        "POD_UID": pod.metadata.uid,
    }
    worker = worker_factory("--engine", ENGINE, "--model", str(tiny_model.base), env=env)
    await worker.wait_health(200, within=120)
    objects = client.CustomObjectsApi(api)

    async def read() -> dict[str, Any]:
        got: dict[str, Any] = await objects.get_namespaced_custom_object(
            *DWM[:2], namespace, DWM[2], pod.metadata.name
        )
        return got

    record = await eventually(read, 30)
    owner = record["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Pod",
        pod.metadata.name,
        pod.metadata.uid,
    )
    managers = {m["manager"] for m in record["metadata"]["managedFields"]}
    assert "dynamo-worker" in managers
    data = record["spec"]["data"]
    assert set(data) >= {"endpoints", "model_cards"}
    assert len(data["endpoints"]) == 1

    status, answer = await post_json(
        worker.system_url() + "/v1/loras", {"lora_name": "tiny-adapter", "source": {"uri": uri}}
    )
    assert status == 200, answer
    status, answer = await post_json(
        worker.system_url() + "/engine/update/model_taints", {"taints": ["maintenance"]}
    )
    assert status == 200, answer

    def updated(got: dict[str, Any]) -> bool:
        cards = json.dumps(got["spec"]["data"]["model_cards"])
        return "tiny-adapter" in cards and "maintenance" in cards

    await eventually(read, 30, until=updated)
    worker.terminate()
    assert await worker.wait_exit() == 0
