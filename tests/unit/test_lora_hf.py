"""`hf://` adapters through the real `huggingface_hub` client against a local Hub imitation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo.common.lora import LoRAManager, adapter_digest
from support.fake_hf_hub import FakeHub, running_hub
from support.lora_adapters import adapter_files, lora_env, read_tree, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


@pytest.fixture
def hub(lora_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with running_hub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def repo_dir(lora_env: Path, repo_id: str) -> Path:
    return lora_env / "hf" / ("models--" + repo_id.replace("/", "--"))


async def test_download_into_the_hub_cache_with_marker_and_ref(
    hub: FakeHub, lora_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = adapter_files() | {"README.md": b"# adapter", "sub/extra.json": b"{}"}
    sha = hub.add_commit("org/adapter", files)
    manager = LoRAManager()
    assert not manager.is_cached("hf://org/adapter")

    result = await manager.download_lora("hf://org/adapter")
    snapshot = repo_dir(lora_env, "org/adapter") / "snapshots" / sha
    assert result == {"status": "success", "local_path": str(snapshot)}
    assert read_tree(snapshot) == files | {".dynamo_lora_complete": b"1\n"}
    assert (repo_dir(lora_env, "org/adapter") / "refs" / "main").read_text() == sha
    assert manager.is_cached("hf://org/adapter")
    assert manager.is_cached(f"hf://org/adapter@{sha}")
    # The LoRA cache root holds only the URI's lock file.
    assert {p.name for p in (lora_env / "cache").iterdir()} == {"hf__org_adapter.lock"}

    # Warm: no request reaches the Hub, even offline.
    before = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert await manager.download_lora("hf://org/adapter") == result
    assert len(hub.requests) == before


async def test_revisions(hub: FakeHub, lora_env: Path) -> None:
    main_sha = hub.add_commit("org/a", adapter_files(seed=1))
    pr_sha = hub.add_commit("org/a", adapter_files(seed=2), revision="refs/pr/7")
    manager = LoRAManager()
    pr = await manager.download_lora("hf://org/a@refs/pr/7")
    assert pr["local_path"].endswith(f"snapshots/{pr_sha}")
    assert (repo_dir(lora_env, "org/a") / "refs" / "refs" / "pr" / "7").read_text() == pr_sha
    pinned = await manager.download_lora(f"hf://org/a@{main_sha}")
    assert pinned["local_path"].endswith(f"snapshots/{main_sha}")
    # A commit pin writes no ref of its own.
    assert not (repo_dir(lora_env, "org/a") / "refs" / "main").exists()
    single = hub.add_commit("legacy", adapter_files())
    assert (await manager.download_lora("hf://legacy"))["local_path"].endswith(single)


async def test_partial_snapshot_is_not_cached(hub: FakeHub, lora_env: Path) -> None:
    sha = hub.add_commit("org/a", adapter_files())
    snapshot = repo_dir(lora_env, "org/a") / "snapshots" / sha
    # What an interrupted download leaves: files and a ref, but no completion marker.
    write_tree(snapshot, adapter_files())
    write_tree(repo_dir(lora_env, "org/a") / "refs", {"main": sha.encode()})
    manager = LoRAManager()
    assert not manager.is_cached("hf://org/a")
    result = await manager.download_lora("hf://org/a")
    assert result["status"] == "success"
    assert (snapshot / ".dynamo_lora_complete").read_bytes() == b"1\n"


@pytest.mark.parametrize(
    ("offline_value", "offline"), [("1", True), ("ON", True), (" true ", True), ("0", False)]
)
async def test_offline_refuses_uncached(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, offline_value: str, offline: bool
) -> None:
    hub.add_commit("org/a", adapter_files())
    monkeypatch.setenv("HF_HUB_OFFLINE", offline_value)
    result = await LoRAManager().download_lora("hf://org/a")
    if offline:
        assert result == {
            "status": "error",
            "message": "Download failed: HF_HUB_OFFLINE is enabled and hf://org/a is not fully "
            "cached",
            "reason": "offline",
        }
        assert hub.requests == []
    else:
        assert result["status"] == "success"


async def test_not_found(hub: FakeHub) -> None:
    hub.add_commit("org/a", adapter_files())
    manager = LoRAManager()
    repo = await manager.download_lora("hf://org/missing")
    assert repo["reason"] == "not found"
    assert "repository for hf://org/missing not found" in repo["message"]
    revision = await manager.download_lora("hf://org/a@nope")
    assert revision["reason"] == "not found"
    assert "revision of hf://org/a@nope not found" in revision["message"]


async def test_listed_file_missing_on_the_server(hub: FakeHub, lora_env: Path) -> None:
    hub.add_commit("org/a", adapter_files(), listed_only=["ghost.bin"])
    result = await LoRAManager().download_lora("hf://org/a")
    assert result["reason"] == "not found"
    assert "a listed file of hf://org/a is missing" in result["message"]
    assert not LoRAManager().is_cached("hf://org/a")


async def test_tokens(hub: FakeHub, lora_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_commit("org/private", adapter_files(), token="hf_right")
    manager = LoRAManager()
    anonymous = await manager.download_lora("hf://org/private")
    assert anonymous["reason"] == "not found"
    assert "also needs HF_TOKEN" in anonymous["message"]

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    wrong = await manager.download_lora("hf://org/private")
    assert wrong["reason"] == "auth"
    assert "check HF_TOKEN" in wrong["message"]

    # The token file under HF_HOME is used when no variable is set.
    monkeypatch.delenv("HF_TOKEN")
    write_tree(lora_env / "hf_home", {"token": b"hf_right\n"})
    assert (await manager.download_lora("hf://org/private"))["status"] == "success"
    assert "hf_right" not in str(hub.requests)


async def test_gated(hub: FakeHub) -> None:
    hub.add_commit("org/gated", adapter_files(), gated=True)
    result = await LoRAManager().download_lora("hf://org/gated")
    assert result["reason"] == "auth"
    assert "is gated" in result["message"]


async def test_timeout(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_commit("org/a", adapter_files())
    hub.info_delay = 5.0
    monkeypatch.setenv("LORA_DOWNLOAD_TIMEOUT_SECS", "0.3")
    result = await LoRAManager().download_lora("hf://org/a")
    assert result["reason"] == "timeout"
    assert "limit 0.3 s" in result["message"]


async def test_unreachable_hub(lora_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    result = await LoRAManager().download_lora("hf://org/a")
    assert result["reason"] == "download failed"
    assert "check HF_ENDPOINT" in result["message"]


async def test_repo_that_is_not_an_adapter(hub: FakeHub) -> None:
    hub.add_commit("org/model", {"config.json": b"{}", "model.safetensors": b"x"})
    result = await LoRAManager().download_lora("hf://org/model")
    assert result["reason"] == "invalid adapter"
    assert "hf://org/model is not a valid LoRA adapter" in result["message"]
    assert not LoRAManager().is_cached("hf://org/model")


async def test_digest(hub: FakeHub, lora_env: Path) -> None:
    hub.add_commit("org/a", adapter_files(seed=3))
    digest = adapter_digest(write_tree(lora_env / "ref", adapter_files(seed=3)))
    manager = LoRAManager()
    wrong = await manager.download_lora_verified("hf://org/a", "1" * 64)
    assert wrong["reason"] == "digest mismatch"
    assert not manager.is_cached("hf://org/a")  # no marker on a mismatching snapshot
    ok = await manager.download_lora_verified("hf://org/a", digest)
    assert ok["status"] == "success"
    assert manager.is_cached("hf://org/a")


async def test_concurrent_callers_download_each_file_once(hub: FakeHub) -> None:
    hub.add_commit("org/a", adapter_files())
    manager = LoRAManager()
    results = await asyncio.gather(*(manager.download_lora("hf://org/a") for _ in range(5)))
    assert {r["status"] for r in results} == {"success"}
    assert hub.count("GET", "/api/models/org/a") == 1
    assert hub.count("GET", "/resolve/") == len(adapter_files())
