"""A real `dynamo-worker` serves its model-card files from its system server.

* File discovery (the frontend on this filesystem): the cards keep absolute local paths, and
  the system server also answers each file under `/v1/metadata/...` with the card's bytes.
* Kubernetes discovery (the test bed's API server; the frontend would be in another pod): the
  worker's DynamoWorkerMetadata names every card file by an `http://` URL on its system
  server; each downloads with the card's blake3 checksum and size.
* Upstream's own frontend (ai-dynamo 1.6.1) given exactly those Kubernetes-published records
  (copied into its file-discovery folder: upstream's Kubernetes reader needs the pod network)
  downloads the files over HTTP, verifies them and serves a chat completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from blake3 import blake3
from kubernetes_asyncio import client

from dynamo.runtime.card_files import BASE_SUFFIX, checked_files
from dynamo.runtime.discovery.file import INSTANCES, MDC, encode_key
from support.cluster import REPO, Cluster, ensure_crd, eventually
from support.tiny_model import TinyModel
from support.upstream import SAMPLE_ENGINE, UpstreamFleet, post_json, upstream_fleet
from support.worker_process import WorkerFactory, WorkerProcess, worker_factory

pytestmark = pytest.mark.e2e
__all__ = ["upstream_fleet", "worker_factory"]

SERVED = "tiny-llama"
ADAPTER = "sql-lora"
DWM = ("nvidia.com", "v1alpha1", "dynamoworkermetadatas")
CARD_FILES = {
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
}


async def get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.read()


async def load_adapter(worker: WorkerProcess, tiny_model: TinyModel) -> None:
    body = {"lora_name": ADAPTER, "source": {"uri": tiny_model.adapters[ADAPTER].as_uri()}}
    status, answer = await post_json(worker.system_url() + "/v1/loras", body)
    assert status == 200, answer


def checksum(data: bytes) -> str:
    return f"blake3:{blake3(data).hexdigest()}"


def card_entries(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    entries = checked_files(record["card_json"])
    assert {e["path"].rsplit("/", 1)[-1] for e in entries} == CARD_FILES
    return entries


def sample_args(tiny_model: TinyModel) -> list[str]:
    return ["--engine", SAMPLE_ENGINE, "--model", str(tiny_model.base)]


def lora_env(tmp_path: Path) -> dict[str, str]:
    return {
        "DYN_LORA_ENABLED": "true",
        "DYN_LORA_PATH": str(tmp_path / "loras"),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])
        ),
    }


async def test_file_discovery_keeps_local_paths_and_the_route_serves_them(
    worker_factory: WorkerFactory, tiny_model: TinyModel, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    env = {**lora_env(tmp_path), "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv)}
    worker = worker_factory(*sample_args(tiny_model), "--served-model-name", SERVED, env=env)
    await worker.wait_health(200)
    await load_adapter(worker, tiny_model)
    system = worker.system_url()
    mdc = kv / MDC

    def cards() -> list[dict[str, Any]]:
        return [json.loads(path.read_text()) for path in sorted(mdc.iterdir())]

    await eventually(lambda: asyncio.to_thread(cards), 30, until=lambda got: len(got) == 2)
    urls: dict[str, list[str]] = {}
    for record in await asyncio.to_thread(cards):
        card = record["card_json"]
        suffix = record.get("model_suffix", BASE_SUFFIX)
        prefix = (
            f"{system}/v1/metadata/{record['namespace']}/{record['component']}/"
            f"{record['endpoint']}/{card['slug']}/{suffix}"
        )
        for entry in card_entries(record):
            local = Path(entry["path"])
            assert local.is_absolute()
            assert local.parent == tiny_model.base.resolve()
            status, body = await get(f"{prefix}/{local.name}")
            assert status == 200, (prefix, local.name)
            assert (checksum(body), len(body)) == (entry["checksum"], entry["size"])
            assert body == await asyncio.to_thread(local.read_bytes)
            urls.setdefault(suffix, []).append(f"{prefix}/{local.name}")
        # The model folder holds more than the card names; those are not served.
        for other in sorted(tiny_model.base.iterdir()):
            if other.name not in CARD_FILES:
                assert (await get(f"{prefix}/{other.name}"))[0] == 404, other.name
    assert set(urls) == {BASE_SUFFIX, "sql-lora"}

    # Unloading the adapter withdraws its card, and with it its files.
    async with (
        aiohttp.ClientSession() as session,
        session.delete(f"{system}/v1/loras/{ADAPTER}") as response,
    ):
        assert response.status == 200
    for url in urls["sql-lora"]:
        assert (await get(url))[0] == 404
    for url in urls[BASE_SUFFIX]:
        assert (await get(url))[0] == 200
    worker.terminate()
    assert await worker.wait_exit() == 0


@contextlib.asynccontextmanager
async def kubernetes_worker(
    start: Any,
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    tiny_model: TinyModel,
    env: Mapping[str, str],
) -> AsyncIterator[tuple[WorkerProcess, dict[str, Any]]]:
    """A worker publishing itself as the pod of a KWOK Pod would; it and its object's
    `spec.data` once published (with the adapter's card)."""
    await ensure_crd(api, REPO / "crds" / "nvidia.com_dynamoworkermetadatas.yaml")
    pod_body: Any = {
        "metadata": {"name": "card-files-0"},
        "spec": {
            "nodeSelector": {"type": "kwok"},
            "containers": [{"name": "main", "image": "example.invalid/worker:1"}],
        },
    }
    pod = await client.CoreV1Api(api).create_namespaced_pod(namespace, pod_body)
    worker: WorkerProcess = start(
        *sample_args(tiny_model),
        "--served-model-name",
        SERVED,
        env={
            **env,
            "DYN_DISCOVERY_BACKEND": "kubernetes",
            "KUBECONFIG": str(cluster.kubeconfig),
            "POD_NAME": pod.metadata.name,
            "POD_NAMESPACE": namespace,
            "POD_UID": pod.metadata.uid,
        },
    )
    await worker.wait_health(200)
    await load_adapter(worker, tiny_model)
    objects = client.CustomObjectsApi(api)

    async def read() -> dict[str, Any]:
        got: dict[str, Any] = await objects.get_namespaced_custom_object(
            *DWM[:2], namespace, DWM[2], pod.metadata.name
        )
        return got

    record = await eventually(read, 30, until=lambda r: len(r["spec"]["data"]["model_cards"]) == 2)
    yield worker, record["spec"]["data"]
    worker.terminate()
    assert await worker.wait_exit() == 0


async def test_kubernetes_cards_name_http_urls_that_download_verified(
    worker_factory: WorkerFactory,
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    tiny_model: TinyModel,
    tmp_path: Path,
) -> None:
    async with kubernetes_worker(
        worker_factory, api, cluster, namespace, tiny_model, lora_env(tmp_path)
    ) as (worker, data):
        system = worker.system_url()
        for record in data["model_cards"].values():
            card = record["card_json"]
            suffix = record.get("model_suffix", BASE_SUFFIX)
            prefix = (
                f"{system}/v1/metadata/{record['namespace']}/{record['component']}/"
                f"{record['endpoint']}/{card['slug']}/{suffix}/"
            )
            for entry in card_entries(record):
                assert entry["path"].startswith(prefix), entry
                status, body = await get(entry["path"])
                assert status == 200, entry
                assert (checksum(body), len(body)) == (entry["checksum"], entry["size"])
                name = entry["path"].removeprefix(prefix)
                assert body == await asyncio.to_thread((tiny_model.base / name).read_bytes)
        assert {r.get("model_suffix", BASE_SUFFIX) for r in data["model_cards"].values()} == {
            BASE_SUFFIX,
            "sql-lora",
        }
        # /metadata shows what was published.
        status, body = await get(system + "/metadata")
        assert status == 200
        assert json.loads(body)["model_cards"] == data["model_cards"]


async def keep_published(records: Mapping[str, Mapping[str, Any]], kv: Path) -> None:
    """Keep `records` (bucket -> key -> record) in an upstream file-discovery folder, touched
    like a live owner's (readers drop records untouched for 10 s), until cancelled."""
    paths = []
    for bucket, by_key in records.items():
        folder = kv / bucket
        folder.mkdir(parents=True, exist_ok=True)
        for key, record in by_key.items():
            staged = folder / f".tmp_{encode_key(key)}"  # readers ignore `.tmp_*`
            staged.write_text(json.dumps(record, separators=(",", ":")))
            staged.rename(folder / encode_key(key))
            paths.append(folder / encode_key(key))
    while True:
        await asyncio.sleep(2)
        for path in paths:
            os.utime(path)


async def test_upstream_frontend_downloads_the_http_card_files(
    upstream_fleet: UpstreamFleet,
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    tiny_model: TinyModel,
    tmp_path: Path,
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    async with kubernetes_worker(
        fleet.start_worker, api, cluster, namespace, tiny_model, lora_env(tmp_path)
    ) as (worker, data):
        entries = [e for r in data["model_cards"].values() for e in card_entries(r)]
        assert all(e["path"].startswith(worker.system_url() + "/") for e in entries)
        mirror = asyncio.create_task(
            keep_published({INSTANCES: data["endpoints"], MDC: data["model_cards"]}, fleet.kv)
        )
        try:
            await fleet.wait_models(SERVED, ADAPTER)
            # Chat needs the tokenizer and the chat template, which the frontend could only
            # have fetched from the URLs (its HOME is empty; the card names no local path).
            chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            for model in (SERVED, ADAPTER):
                status, answer = await post_json(
                    frontend + "/v1/chat/completions", {**chat, "model": model}
                )
                assert status == 200, (answer, fleet.logs())
                assert answer["usage"]["completion_tokens"] == 4
                assert answer["usage"]["prompt_tokens"] > 0
        finally:
            mirror.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mirror
        # The frontend keeps what it downloaded and verified, by checksum.
        cached = {p.name for p in (fleet.home / ".cache").rglob("*") if p.is_file()}
        for entry in entries:
            assert entry["checksum"].removeprefix("blake3:") in cached, (entry, sorted(cached))
