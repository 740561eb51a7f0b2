"""Card capture: the cards a pod published, their files fetched from its system server,
checked, and served again by the activator's own system server under its URL."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dynamo.activator.cards import CaptureError, capture, file_key
from dynamo.activator.metrics import ActivatorMetrics
from dynamo.activator.pods import ReadyPod, served_models
from dynamo.activator.system import SystemServer
from dynamo.runtime.card_files import allow_list, checked_files
from dynamo.runtime.discovery.base import AdapterCard, EndpointAddress, WorkerAdvertisement
from dynamo.runtime.discovery.records import discovery_metadata, kubernetes_instance_id, model_files

pytestmark = pytest.mark.unit

ACTIVATOR_BASE = "http://10.9.9.9:9090"


def model_dir(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    (root / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    return root


def advertisement(model: Path, base_url: str | None, pod: str = "llama-0") -> WorkerAdvertisement:
    return WorkerAdvertisement(
        address=EndpointAddress("dynamo", "backend", "generate"),
        instance_id=kubernetes_instance_id(pod),
        served_model_name="llama",
        model=str(model),
        transport={"tcp": "10.0.0.7:9345/x/dynamo/backend/generate"},
        adapters=(AdapterCard("sql-lora", 1, "s3://b/sql"),),
        card_file_base_url=base_url,
    )


@pytest.fixture
async def pod_system(tmp_path: Path) -> AsyncIterator[tuple[dict[str, Any], Path]]:
    """A pod's system server answering its card files; its metadata and model dir."""
    model = model_dir(tmp_path / "model")
    files = allow_list(discovery_metadata(advertisement(model, None), model_files(str(model))))

    async def card_file(request: web.Request) -> web.Response:
        key = file_key(str(request.url))
        path = files.get(key) if key else None
        if path is None or not path.is_file():
            return web.Response(status=404)
        return web.Response(body=path.read_bytes())

    app = web.Application()
    app.router.add_get("/{tail:.*}", card_file)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    metadata = discovery_metadata(advertisement(model, base), model_files(str(model)))
    yield metadata, model
    await runner.cleanup()


async def test_capture_fetches_every_file_and_rewrites_urls_to_the_activator(
    pod_system: tuple[dict[str, Any], Path],
) -> None:
    metadata, model = pod_system
    async with aiohttp.ClientSession() as session:
        cards = await capture(session, "llama-0", metadata, ACTIVATOR_BASE)
    assert set(cards.records) == set(metadata["model_cards"])  # base and the LoRA card
    urls = [
        entry["path"]
        for record in cards.records.values()
        for entry in checked_files(record["card_json"])
    ]
    assert len(urls) == 6  # three files on each of the two cards
    assert all(
        url.startswith(ACTIVATOR_BASE + "/v1/metadata/dynamo/backend/generate/") for url in urls
    )
    # Every URL names bytes the activator holds, equal to the model's file.
    for url in urls:
        key = file_key(url)
        assert key is not None
        assert cards.files[key] == (model / key.filename).read_bytes()
    # Checksums and sizes are the pod's (the frontend verifies them).
    pod_entries = [
        e for r in metadata["model_cards"].values() for e in checked_files(r["card_json"])
    ]
    assert [(e["checksum"], e["size"]) for e in pod_entries] == [
        (e["checksum"], e["size"])
        for r in cards.records.values()
        for e in checked_files(r["card_json"])
    ]
    listing = cards.listing(created=1)
    assert [(m["id"], m.get("parent")) for m in listing["data"]] == [
        ("llama", None),
        ("sql-lora", "llama"),
    ]
    assert served_models(metadata) == {"llama", "sql-lora"}


async def test_a_file_that_does_not_match_its_card_fails_the_capture(
    pod_system: tuple[dict[str, Any], Path],
) -> None:
    metadata, model = pod_system
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"b": 1}}}))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(CaptureError, match=r"tokenizer\.json.*(checksum|blake3|bytes)"):
            await capture(session, "llama-0", metadata, ACTIVATOR_BASE)


async def test_a_pod_without_cards_or_with_a_missing_file_fails_the_capture(
    pod_system: tuple[dict[str, Any], Path],
) -> None:
    metadata, model = pod_system
    async with aiohttp.ClientSession() as session:
        with pytest.raises(CaptureError, match="no model card"):
            await capture(session, "llama-0", {**metadata, "model_cards": {}}, ACTIVATOR_BASE)
        (model / "config.json").unlink()
        with pytest.raises(CaptureError, match="HTTP 404"):
            await capture(session, "llama-0", metadata, ACTIVATOR_BASE)


async def test_the_system_server_serves_captured_files_and_nothing_else(
    pod_system: tuple[dict[str, Any], Path],
) -> None:
    metadata, model = pod_system
    metrics = ActivatorMetrics()
    async with aiohttp.ClientSession() as session:
        cards = await capture(session, "llama-0", metadata, ACTIVATOR_BASE)
        metrics.card_ready.set(1)
        runner = web.AppRunner(SystemServer(metrics, lambda: cards, lambda: True).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            some_url = next(
                e["path"]
                for r in cards.records.values()
                for e in checked_files(r["card_json"])
                if e["path"].endswith("config.json")
            )
            local = base + some_url.removeprefix(ACTIVATOR_BASE)
            async with session.get(local) as response:
                assert response.status == 200
                assert await response.read() == (model / "config.json").read_bytes()
            async with session.get(local.replace("config.json", "secrets.json")) as response:
                assert response.status == 404
            async with session.post(local) as response:
                assert response.status == 405
            async with session.get(base + "/engine/loras") as response:
                assert response.status == 404
            for path in ("/health", "/live", "/ready"):
                async with session.get(base + path) as response:
                    assert response.status == 200
            async with session.get(base + "/metrics") as response:
                text = await response.text()
        finally:
            await runner.cleanup()
    for name in (
        "dynamo_activator_held_requests ",
        "dynamo_activator_wait_seconds_bucket",
        "dynamo_activator_expired_total",
        "dynamo_activator_refused_total",
        "dynamo_activator_forwarded_total",
        "dynamo_activator_card_ready 1.0",
    ):
        assert name in text


def test_ready_pods_join_slices_and_metadata() -> None:
    from dynamo.activator.pods import ready_pods

    metadata = discovery_metadata(advertisement(Path("/nowhere"), None))
    withdrawn = {**metadata, "endpoints": {}}

    def endpoint(name: str, ip: str, ready: bool) -> dict[str, Any]:
        return {
            "addresses": [ip],
            "conditions": {"ready": ready},
            "targetRef": {"kind": "Pod", "name": name},
        }

    slices = [
        {"endpoints": [endpoint("b", "10.0.0.2", True), endpoint("c", "10.0.0.3", False)]},
        {"endpoints": [endpoint("a", "10.0.0.1", True), endpoint("d", "10.0.0.4", True)]},
        {"endpoints": [endpoint("e", "10.0.0.5", True)]},
    ]
    pods = ready_pods(slices, {"a": metadata, "b": metadata, "c": metadata, "e": withdrawn}, 8000)
    assert [(p.name, p.http_url) for p in pods] == [
        ("a", "http://10.0.0.1:8000"),
        ("b", "http://10.0.0.2:8000"),
    ]
    assert pods[0].tcp_address == "10.0.0.7:9345/x/dynamo/backend/generate"
    assert pods[0].models == {"llama", "sql-lora"}
    assert dataclasses.replace(pods[0], metadata={}) == pods[0]  # metadata not compared
    assert ReadyPod("x", "u", None, frozenset({"llama"}), {}).serves(None)
