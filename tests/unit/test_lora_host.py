"""`LoRAAdapterHost` with real PEFT-format adapter directories (file://) and a real S3 server."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import blake3
import pytest

from dynamo.common.lora import LoRAManager, OnceLock, adapter_digest, s3_source
from dynamo.common.lora import manager as manager_module
from dynamo.engines.lora_host import LORA_UPDATES, LoadedAdapter, LoRAAdapterHost, lora_name_to_id
from support.lora_adapters import adapter_files, lora_env, write_tree
from support.s3 import S3Server

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


class RecordingEngine:
    """The two engine callbacks, recording what the host asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail_load = False
        self.gate: asyncio.Event | None = None

    async def load(self, name: str, lora_id: int, path: Path) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_load:
            raise RuntimeError("out of adapter slots on the device")
        assert (path / "adapter_config.json").is_file()
        self.calls.append(("load", name, str(lora_id), str(path)))

    async def unload(self, name: str, lora_id: int) -> None:
        self.calls.append(("unload", name, str(lora_id)))


def make_host(engine: RecordingEngine, max_loras: int = 4) -> LoRAAdapterHost:
    return LoRAAdapterHost(
        max_loras=max_loras, load=engine.load, unload=engine.unload, manager=LoRAManager()
    )


def adapter_dir(root: Path, name: str, seed: int) -> Path:
    return write_tree(root / "adapters" / name, adapter_files(seed))


def load_body(name: str, uri: str, **source: str) -> dict[str, object]:
    return {"lora_name": name, "source": {"uri": uri, **source}}


def test_lora_updates_names() -> None:
    assert frozenset({"load_lora", "unload_lora", "list_loras"}) == LORA_UPDATES


@pytest.mark.parametrize("name", ["my-lora", "a", "org/adapter-v2", ""])
def test_lora_name_to_id_follows_the_blake3_rule(name: str) -> None:
    digest = blake3.blake3(name.encode()).digest()
    (as_u64,) = struct.unpack(">Q", digest[:8])
    (as_i32,) = struct.unpack("<i", struct.pack("<I", as_u64 & 0x7FFFFFFF))
    expected = abs(as_i32) or 1
    assert lora_name_to_id(name) == expected
    assert 1 <= lora_name_to_id(name) <= 0x7FFFFFFF


async def test_load_list_unload_file_adapter(lora_env: Path) -> None:
    engine = RecordingEngine()
    host = make_host(engine)
    path = adapter_dir(lora_env, "one", seed=1)
    lora_id = lora_name_to_id("one")

    response = await host.handle("load_lora", load_body("one", f"file://{path}"))
    assert response == {
        "status": "success",
        "message": "LoRA adapter 'one' loaded successfully",
        "lora_name": "one",
        "lora_id": lora_id,
        "hot_swap": False,
        "downloaded_bytes": 0,
    }
    assert engine.calls == [("load", "one", str(lora_id), str(path))]
    assert host.loaded() == {"one": LoadedAdapter(lora_id, f"file://{path}", path)}
    assert await host.handle("list_loras", {}) == {
        "status": "success",
        "loras": {"one": lora_id},
        "count": 1,
        "sources": {"one": {"uri": f"file://{path}"}},
    }

    response = await host.handle("unload_lora", {"lora_name": "one"})
    assert response == {
        "status": "success",
        "message": "LoRA adapter 'one' unloaded successfully",
        "lora_name": "one",
        "lora_id": lora_id,
    }
    assert engine.calls[-1] == ("unload", "one", str(lora_id))
    assert host.loaded() == {}
    assert (await host.handle("list_loras", {}))["count"] == 0


async def test_repeated_load_from_same_uri_is_already_loaded(lora_env: Path) -> None:
    engine = RecordingEngine()
    host = make_host(engine)
    uri = f"file://{adapter_dir(lora_env, 'one', seed=1)}"
    assert (await host.handle("load_lora", load_body("one", uri)))["status"] == "success"
    again = await host.handle("load_lora", load_body("one", uri))
    assert again["status"] == "success"
    assert again["message"] == "LoRA adapter 'one' already loaded"
    assert again["hot_swap"] is False
    assert len(engine.calls) == 1


async def test_concurrent_loads_of_one_name_load_once(lora_env: Path) -> None:
    engine = RecordingEngine()
    engine.gate = asyncio.Event()
    host = make_host(engine)
    uri = f"file://{adapter_dir(lora_env, 'one', seed=1)}"
    tasks = [asyncio.create_task(host.handle("load_lora", load_body("one", uri))) for _ in range(5)]
    await asyncio.sleep(0)
    engine.gate.set()
    results = await asyncio.gather(*tasks)
    assert all(result["status"] == "success" for result in results)
    assert [call[0] for call in engine.calls] == ["load"]


async def test_different_uri_is_a_hot_swap(lora_env: Path) -> None:
    engine = RecordingEngine()
    host = make_host(engine, max_loras=1)
    first = adapter_dir(lora_env, "v1", seed=1)
    second = adapter_dir(lora_env, "v2", seed=2)
    await host.handle("load_lora", load_body("one", f"file://{first}"))
    # A hot swap does not need a free slot: the name keeps its slot.
    response = await host.handle("load_lora", load_body("one", f"file://{second}"))
    assert response["status"] == "success"
    assert response["hot_swap"] is True
    assert response["message"] == "LoRA adapter 'one' hot-swapped successfully"
    assert engine.calls[-1] == ("load", "one", str(lora_name_to_id("one")), str(second))
    assert host.loaded()["one"].path == second


async def test_failed_hot_swap_keeps_the_old_adapter(lora_env: Path) -> None:
    engine = RecordingEngine()
    host = make_host(engine)
    first = adapter_dir(lora_env, "v1", seed=1)
    await host.handle("load_lora", load_body("one", f"file://{first}"))
    engine.fail_load = True
    response = await host.handle("load_lora", load_body("one", f"file://{lora_env}/missing"))
    assert response["status"] == "error"
    assert response["reason"] == "not found"
    response = await host.handle(
        "load_lora", load_body("one", f"file://{adapter_dir(lora_env, 'v2', 2)}")
    )
    assert response == {
        "status": "error",
        "message": "Failed to load LoRA adapter 'one': out of adapter slots on the device",
        "reason": "engine",
        "lora_name": "one",
    }
    assert host.loaded()["one"].path == first


async def test_capacity_error_is_exact(lora_env: Path) -> None:
    engine = RecordingEngine()
    host = make_host(engine, max_loras=2)
    for index in range(2):
        uri = f"file://{adapter_dir(lora_env, f'a{index}', seed=index)}"
        assert (await host.handle("load_lora", load_body(f"a{index}", uri)))["status"] == "success"
    uri = f"file://{adapter_dir(lora_env, 'a2', seed=2)}"
    assert await host.handle("load_lora", load_body("a2", uri)) == {
        "status": "error",
        "message": "LoRA capacity exceeded: at most 2 adapter(s) may be loaded",
        "reason": "capacity",
        "lora_name": "a2",
    }
    # Unloading frees the slot.
    await host.handle("unload_lora", {"lora_name": "a0"})
    assert (await host.handle("load_lora", load_body("a2", uri)))["status"] == "success"


async def test_concurrent_loads_of_different_names_respect_capacity(lora_env: Path) -> None:
    engine = RecordingEngine()
    engine.gate = asyncio.Event()
    host = make_host(engine, max_loras=1)
    uris = [f"file://{adapter_dir(lora_env, f'n{i}', seed=i)}" for i in range(3)]
    tasks = [
        asyncio.create_task(host.handle("load_lora", load_body(f"n{i}", uri)))
        for i, uri in enumerate(uris)
    ]
    await asyncio.sleep(0.05)
    engine.gate.set()
    results = await asyncio.gather(*tasks)
    assert sorted(result["status"] for result in results) == ["error", "error", "success"]
    assert len(host.loaded()) == 1


async def test_sha256_is_checked(lora_env: Path) -> None:
    engine = RecordingEngine()
    host = make_host(engine)
    path = adapter_dir(lora_env, "one", seed=1)
    other = adapter_dir(lora_env, "other", seed=9)
    wrong = await host.handle(
        "load_lora", load_body("one", f"file://{path}", sha256=adapter_digest(other))
    )
    assert wrong["status"] == "error"
    assert "digest mismatch" in wrong["message"]
    assert wrong["message"].startswith("Failed to download LoRA: ")
    assert wrong["reason"] == "digest mismatch"
    assert engine.calls == []

    digest = adapter_digest(path)
    right = await host.handle("load_lora", load_body("one", f"file://{path}", sha256=digest))
    assert right["status"] == "success"
    assert host.loaded()["one"].sha256 == digest


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "'lora_name' is required and must be a string"),
        ({"lora_name": "x"}, "'source' object is required in request"),
        ({"lora_name": "x", "source": {}}, "'source.uri' is required and must be a string"),
        (
            {"lora_name": "x", "source": {"uri": "file:///x", "sha256": 5}},
            "'source.sha256' must be a string of 64 hexadecimal digits",
        ),
    ],
)
async def test_bad_load_bodies(lora_env: Path, body: dict[str, object], message: str) -> None:
    response = await make_host(RecordingEngine()).handle("load_lora", body)
    assert response == {"status": "error", "message": message, "reason": "bad request"}


async def test_unload_unknown_lists_available(lora_env: Path) -> None:
    engine = RecordingEngine()
    host = make_host(engine)
    uri = f"file://{adapter_dir(lora_env, 'one', seed=1)}"
    await host.handle("load_lora", load_body("one", uri))
    response = await host.handle("unload_lora", {"lora_name": "two"})
    assert response["status"] == "error"
    assert response["message"] == "LoRA adapter 'two' not found. Available LoRAs: ['one']"
    bad = await host.handle("unload_lora", {})
    assert bad["status"] == "error"
    assert bad["reason"] == "bad request"


async def test_unknown_update_name(lora_env: Path) -> None:
    response = await make_host(RecordingEngine()).handle("reload_lora", {})
    assert response == {"status": "error", "message": "unsupported engine update: reload_lora"}


async def test_without_a_manager_it_needs_dyn_lora_enabled(
    lora_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manager_module, "_lora_manager", OnceLock())
    engine = RecordingEngine()
    host = LoRAAdapterHost(max_loras=1, load=engine.load, unload=engine.unload)
    uri = f"file://{adapter_dir(lora_env, 'one', seed=1)}"
    response = await host.handle("load_lora", load_body("one", uri))
    assert response["status"] == "error"
    assert response["message"].startswith("LoRAManager not initialized. Set DYN_LORA_ENABLED=true")
    monkeypatch.setenv("DYN_LORA_ENABLED", "true")
    assert (await host.handle("load_lora", load_body("one", uri)))["status"] == "success"


def test_negative_capacity_is_refused() -> None:
    engine = RecordingEngine()
    with pytest.raises(ValueError, match="max_loras must be >= 0"):
        LoRAAdapterHost(max_loras=-1, load=engine.load, unload=engine.unload)


async def test_s3_adapter_counts_downloaded_bytes_once(
    lora_env: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setattr(s3_source, "RETRY_DELAYS", (0.01, 0.01))
    bucket = s3_server.new_bucket()
    files = adapter_files(3)
    client = s3_server.client()
    for name, content in files.items():
        client.put_object(Bucket=bucket, Key=f"loras/x/{name}", Body=content)
    uri = f"s3://{bucket}/loras/x"

    engine = RecordingEngine()
    first = await make_host(engine).handle("load_lora", load_body("x", uri))
    assert first["status"] == "success"
    # The payload plus the cache's small completion marker.
    assert first["downloaded_bytes"] >= sum(len(content) for content in files.values())
    # A second engine finds it in the cache: nothing downloaded.
    second = await make_host(RecordingEngine()).handle("load_lora", load_body("x", uri))
    assert second["status"] == "success"
    assert second["downloaded_bytes"] == 0

    missing = await make_host(engine).handle("load_lora", load_body("y", f"s3://{bucket}/none"))
    assert missing["status"] == "error"
    assert missing["message"].startswith("Failed to download LoRA: ")
    assert missing["reason"] == "not found"
