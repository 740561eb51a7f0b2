"""Model-card files: the URLs the cards name under Kubernetes discovery, the local paths they
keep otherwise, and the system server's `/v1/metadata/...` route, which answers only the files
the cards name (hostile paths are sent raw, byte for byte, to a real loopback server)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from blake3 import blake3

from dynamo.runtime.card_files import (
    BASE_SUFFIX,
    CardFileKey,
    allow_list,
    card_file_base_url,
    checked_files,
    with_urls,
)
from dynamo.runtime.discovery import AdapterCard, EndpointAddress, WorkerAdvertisement
from dynamo.runtime.discovery.records import card_file_paths, discovery_metadata, model_files
from dynamo.runtime.health import HealthState
from dynamo.runtime.metrics import RuntimeMetrics, auto_labels
from dynamo.runtime.system.admin import EngineRoutes
from dynamo.runtime.system.server import SystemServer

pytestmark = pytest.mark.unit

ADDRESS = EndpointAddress("dynamo", "backend", "generate")
CARD_FILE_NAMES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)
BASE = "http://198.18.1.5:9090"
FILE_FIELDS = {"model_info", "tokenizer", "prompt_formatter", "chat_template_file", "gen_config"}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder with every card file, plus files no card names."""
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text('{"max_position_embeddings": 512}')
    (root / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}' * 50)
    (root / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (root / "generation_config.json").write_text('{"temperature": 0.7}')
    (root / "model.safetensors").write_bytes(b"\x00weights")
    (root / "secret.txt").write_text("not a card file")
    return root.resolve()


def advertisement(model: Path, **changes: Any) -> WorkerAdvertisement:
    fields: dict[str, Any] = {
        "address": ADDRESS,
        "instance_id": 0x43710F49C0CFF,
        "served_model_name": "Tiny-Llama",
        "model": str(model),
        "transport": {"tcp": "198.18.1.5:4000/43710f49c0cff/dynamo/backend/generate"},
        "adapters": (AdapterCard("My-LoRA.v1", 7, "s3://bucket/a"),),
    }
    fields.update(changes)
    return WorkerAdvertisement(**fields)


def blake3_of(data: bytes) -> str:
    return f"blake3:{blake3(data).hexdigest()}"


# --- the cards' file entries ------------------------------------------------------------


def test_local_cards_name_absolute_paths_and_the_allow_list_follows_them(
    model_dir: Path,
) -> None:
    adv = advertisement(model_dir)
    metadata = discovery_metadata(adv, model_files(adv.model))
    cards = metadata["model_cards"]
    base = cards["dynamo/backend/generate/43710f49c0cff"]["card_json"]
    assert [Path(e["path"]).name for e in checked_files(base)] == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ]
    assert all(e["path"] == str(model_dir / Path(e["path"]).name) for e in checked_files(base))

    allowed = allow_list(metadata)
    # One entry per file per card: the base under `_base`, the adapter under its own slug.
    assert len(allowed) == 2 * len(CARD_FILE_NAMES)
    for name in CARD_FILE_NAMES:
        base_key = CardFileKey("dynamo", "backend", "generate", "tiny-llama", BASE_SUFFIX, name)
        lora_key = CardFileKey("dynamo", "backend", "generate", "my-lora_v1", "my-lora_v1", name)
        assert allowed[base_key] == model_dir / name
        assert allowed[lora_key] == model_dir / name
    assert card_file_paths(adv) == allowed


def test_kubernetes_cards_name_urls_with_the_same_checksum_and_size(model_dir: Path) -> None:
    local_adv = advertisement(model_dir)
    local = discovery_metadata(local_adv, model_files(local_adv.model))
    adv = advertisement(model_dir, card_file_base_url=BASE)
    published = discovery_metadata(adv, model_files(adv.model))
    for key, record in published["model_cards"].items():
        card = record["card_json"]
        local_entries = checked_files(local["model_cards"][key]["card_json"])
        entries = checked_files(card)
        assert len(entries) == len(CARD_FILE_NAMES)
        suffix = record.get("model_suffix", BASE_SUFFIX)
        for entry, local_entry in zip(entries, local_entries, strict=True):
            name = Path(local_entry["path"]).name
            assert entry["path"] == (
                f"{BASE}/v1/metadata/dynamo/backend/generate/{card['slug']}/{suffix}/{name}"
            )
            assert (entry["checksum"], entry["size"]) == (
                local_entry["checksum"],
                local_entry["size"],
            )
            data = (model_dir / name).read_bytes()
            assert (entry["checksum"], entry["size"]) == (blake3_of(data), len(data))
        # Nothing else in the card changed.
        local_card = local["model_cards"][key]["card_json"]
        assert {k: v for k, v in card.items() if k not in FILE_FIELDS} == {
            k: v for k, v in local_card.items() if k not in FILE_FIELDS
        }
    # The upstream-observed form for the base card.
    base = published["model_cards"]["dynamo/backend/generate/43710f49c0cff"]["card_json"]
    assert base["prompt_formatter"]["hf_tokenizer_config_json"]["path"] == (
        "http://198.18.1.5:9090/v1/metadata/dynamo/backend/generate/tiny-llama/_base/"
        "tokenizer_config.json"
    )
    assert base["chat_template_file"]["hf_chat_template"]["is_custom"] is False
    # The system server still serves the local files behind those URLs.
    assert card_file_paths(adv) == allow_list(local)
    # A URL is not a file of ours: rewriting twice changes nothing, and it lists nothing.
    assert with_urls(published, "http://elsewhere:1") == published
    assert allow_list(published) == {}


def test_with_urls_copies_and_quotes_each_segment(model_dir: Path) -> None:
    adv = advertisement(model_dir, address=EndpointAddress("ns.x", "comp %", "ep"))
    local = discovery_metadata(adv, model_files(adv.model))
    before = repr(local)
    rewritten = with_urls(local, BASE)
    assert repr(local) == before  # the input is left alone
    key = CardFileKey("ns.x", "comp %", "ep", "tiny-llama", BASE_SUFFIX, "config.json")
    assert key.url(BASE) == f"{BASE}/v1/metadata/ns.x/comp%20%25/ep/tiny-llama/_base/config.json"
    urls = {
        e["path"] for r in rewritten["model_cards"].values() for e in checked_files(r["card_json"])
    }
    assert key.url(BASE) in urls


def test_a_card_without_files_serves_nothing(tmp_path: Path) -> None:
    adv = advertisement(tmp_path / "missing", card_file_base_url=BASE)
    assert card_file_paths(adv) == {}
    card = discovery_metadata(adv)["model_cards"]["dynamo/backend/generate/43710f49c0cff"]
    assert checked_files(card["card_json"]) == []


# --- the one decision: local paths or URLs ---------------------------------------------


@pytest.mark.parametrize("backend", ["file", "mem", "FILE", " mem "])
def test_file_and_mem_discovery_keep_local_paths(backend: str) -> None:
    assert card_file_base_url(backend, "0.0.0.0", 9090, {"POD_IP": "198.18.1.5"}) is None


@pytest.mark.parametrize(
    ("host", "environ", "expected"),
    [
        ("0.0.0.0", {"POD_IP": "198.18.1.5"}, "http://198.18.1.5:9090"),
        ("", {"POD_IP": "198.18.1.5"}, "http://198.18.1.5:9090"),
        ("::", {"POD_IP": "fd00::5"}, "http://[fd00::5]:9090"),
        ("[::]", {"POD_IP": "fd00:0::5"}, "http://[fd00::5]:9090"),
        ("198.18.1.9", {"POD_IP": "198.18.1.5"}, "http://198.18.1.9:9090"),
        ("[fd00::9]", {}, "http://[fd00::9]:9090"),
        ("0.0.0.0", {}, "http://127.0.0.1:9090"),
        ("localhost", {}, "http://127.0.0.1:9090"),
    ],
)
def test_kubernetes_discovery_publishes_urls_on_the_advertised_host(
    host: str, environ: dict[str, str], expected: str
) -> None:
    assert card_file_base_url("kubernetes", host, 9090, environ) == expected


def test_kubernetes_without_a_system_server_keeps_local_paths_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="dynamo.runtime.card_files"):
        assert card_file_base_url("kubernetes", "0.0.0.0", None, {"POD_IP": "1.2.3.4"}) is None
    assert "set DYN_SYSTEM_PORT" in caplog.text


# --- the system server's route ----------------------------------------------------------


class Route:
    """A real loopback system server whose allow-list is `self.allowed`."""

    def __init__(self) -> None:
        self.allowed: dict[CardFileKey, Path] = {}
        self.asked = 0

    async def source(self) -> dict[CardFileKey, Path]:
        self.asked += 1
        return self.allowed


async def start(route: Route | None) -> TestClient[Any, Any]:
    kwargs: dict[str, Any] = {} if route is None else {"card_files": route.source}
    server = SystemServer(
        health=HealthState(),
        metrics=RuntimeMetrics(auto_labels("dynamo", "backend", "generate", 1)),
        routes=EngineRoutes(),
        metadata=lambda: None,
        **kwargs,
    )
    client: TestClient[Any, Any] = TestClient(TestServer(server.app(), host="127.0.0.1"))
    await client.start_server()
    return client


async def raw_get(client: TestClient[Any, Any], target: str) -> tuple[int, bytes]:
    """GET `target` exactly as written (no client-side normalisation or quoting)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_route_serves_exactly_the_card_files(model_dir: Path) -> None:
    adv = advertisement(model_dir, card_file_base_url=BASE)
    route = Route()
    route.allowed = card_file_paths(adv)
    published = discovery_metadata(adv, model_files(adv.model))
    client = await start(route)
    try:
        served = 0
        for record in published["model_cards"].values():
            for entry in checked_files(record["card_json"]):
                path = entry["path"].removeprefix(BASE)
                response = await client.get(path)
                assert response.status == 200, path
                assert response.content_type == "application/octet-stream"
                body = await response.read()
                assert blake3_of(body) == entry["checksum"]
                assert len(body) == entry["size"]
                served += 1
        assert served == 2 * len(CARD_FILE_NAMES)

        prefix = "/v1/metadata/dynamo/backend/generate/tiny-llama/_base"
        hostile = [
            f"{prefix}/../../../../../../etc/passwd",
            f"{prefix}/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
            f"{prefix}/%2e%2e%2f%2e%2e%2fmodel%2fconfig.json",
            f"{prefix}//etc/passwd",
            f"{prefix}/%2Fetc%2Fpasswd",
            f"{prefix}/{model_dir}/config.json",
            f"{prefix}/config.json%00",
            f"{prefix}/config.json%00.txt",
            f"{prefix}/./config.json",
            f"{prefix}/secret.txt",  # in the model folder, in no card
            f"{prefix}/model.safetensors",
            f"{prefix}/CONFIG.JSON",
            "/v1/metadata/dynamo/backend/generate/tiny-llama/my-lora_v1/config.json",
            "/v1/metadata/dynamo/backend/generate/other/_base/config.json",
            "/v1/metadata/dynamo/backend/other/tiny-llama/_base/config.json",
            "/v1/metadata/dynamo/backend/generate/tiny-llama/_base",
            "/v1/metadata/../../etc/passwd",
        ]
        for target in hostile:
            status, body = await raw_get(client, target)
            assert status == 404, (target, body)
            assert b"root:" not in body
            assert b"weights" not in body
        # An allowed name answers over the same raw path, so the 404s are the allow-list's.
        assert (await raw_get(client, f"{prefix}/config.json"))[0] == 200
        assert (await raw_get(client, f"{prefix}/secret.txt"))[1] == b"Not found"
    finally:
        await client.close()


async def test_route_answers_500_when_a_listed_file_cannot_be_read(model_dir: Path) -> None:
    route = Route()
    key = CardFileKey("dynamo", "backend", "generate", "tiny-llama", BASE_SUFFIX, "gone.json")
    route.allowed = {key: model_dir / "gone.json"}
    client = await start(route)
    try:
        response = await client.get(key.url(""))
        assert response.status == 500
        assert await response.text() == "Failed to read file"
    finally:
        await client.close()


async def test_route_follows_the_allow_list_and_is_empty_by_default(model_dir: Path) -> None:
    key = CardFileKey("dynamo", "backend", "generate", "tiny-llama", BASE_SUFFIX, "config.json")
    client = await start(None)
    try:
        response = await client.get(key.url(""))
        assert response.status == 404
        assert await response.text() == "Not found"
    finally:
        await client.close()
    route = Route()
    client = await start(route)
    try:
        assert (await client.get(key.url(""))).status == 404
        route.allowed = {key: model_dir / "config.json"}  # e.g. a card published since
        response = await client.get(key.url(""))
        assert response.status == 200
        assert await response.read() == (model_dir / "config.json").read_bytes()
        route.allowed = {}  # the card withdrawn
        assert (await client.get(key.url(""))).status == 404
        assert route.asked == 3
    finally:
        await client.close()
