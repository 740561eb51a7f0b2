"""`file://` pass-through, custom sources, URI errors and digests through `LoRAManager`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dynamo.common.lora import LoRAManager, adapter_digest
from support.lora_adapters import adapter_files, lora_env, read_tree, snapshot_of, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


async def test_file_uri_returns_the_directory_itself(lora_env: Path) -> None:
    source = write_tree(lora_env / "adapters" / "mine", adapter_files())
    result = await LoRAManager().download_lora(f"file://{source}")
    assert result == {"status": "success", "local_path": str(source)}
    # No copy is made: the cache root is not even created.
    assert not (lora_env / "cache").exists()


@pytest.mark.parametrize(
    ("make", "uri_suffix", "reason", "message"),
    [
        (None, "/nope", "not found", "Download failed: Local LoRA not found: file://"),
        ("file", "/plain", "invalid adapter", "LoRA path is not a directory"),
        ("empty", "/empty", "invalid adapter", "has no adapter_config.json"),
        ("noweights", "/noweights", "invalid adapter", "has none of the weight files"),
    ],
)
async def test_file_uri_failures(
    lora_env: Path, make: str | None, uri_suffix: str, reason: str, message: str
) -> None:
    base = lora_env / "src"
    base.mkdir()
    if make == "file":
        (base / "plain").write_text("x")
    elif make == "empty":
        (base / "empty").mkdir()
    elif make == "noweights":
        write_tree(base / "noweights", {"adapter_config.json": b"{}"})
    result = await LoRAManager().download_lora(f"file://{base}{uri_suffix}")
    assert result["status"] == "error"
    assert result["reason"] == reason
    assert message in result["message"]


async def test_file_uri_allows_links_inside_and_refuses_links_outside(lora_env: Path) -> None:
    source = write_tree(lora_env / "src", adapter_files())
    (source / "alias.json").symlink_to(source / "adapter_config.json")
    manager = LoRAManager()
    assert (await manager.download_lora(f"file://{source}"))["status"] == "success"

    secret = lora_env / "secret.txt"
    secret.write_text("do not read")
    (source / "escape").symlink_to(secret)
    result = await manager.download_lora(f"file://{source}")
    assert result["status"] == "error"
    assert result["reason"] == "unsafe source"
    assert "escape is a symlink to" in result["message"]
    assert "outside the adapter directory" in result["message"]

    (source / "escape").unlink()
    (source / "rootlink").symlink_to("/")
    result = await manager.download_lora(f"file://{source}")
    assert result["reason"] == "unsafe source"


async def test_file_uri_file_count_bound(lora_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_LORA_MAX_FILES", "5")
    files = adapter_files() | {f"extra/{i}.txt": b"x" for i in range(4)}
    source = write_tree(lora_env / "src", files)
    result = await LoRAManager().download_lora(f"file://{source}")
    assert result["reason"] == "unsafe source"
    assert "more than the limit of 5" in result["message"]


@pytest.mark.parametrize(
    ("uri", "reason", "message"),
    [
        ("no-scheme/path", "bad uri", "has no scheme"),
        ("ftp://host/lora", "bad uri", "unsupported LoRA URI scheme 'ftp'"),
        ("file://", "bad uri", "names no directory"),
        ("s3://bucket", "bad uri", "empty prefix"),
        ("s3://bucket/", "bad uri", "empty prefix"),
        ("s3:///prefix", "bad uri", "names no bucket"),
        ("s3://key:secret@bucket/lora", "bad uri", "embeds credentials"),
        ("s3://b/a/../c", "bad uri", "'..'"),
        ("s3://b/lora?versionId=1", "bad uri", "query or fragment"),
        ("hf://user:token@org/repo", "bad uri", "embeds credentials"),
        ("hf://a/b/c", "bad uri", "does not name a Hub repository"),
        ("hf://org/../repo", "bad uri", "does not name a Hub repository"),
        ("hf://org/repo@", "bad uri", "empty revision"),
        ("hf://org/repo@refs/../x", "bad uri", "'..'"),
        ("hf://org/repo#x", "bad uri", "query or fragment"),
    ],
)
async def test_bad_uris(lora_env: Path, uri: str, reason: str, message: str) -> None:
    result = await LoRAManager().download_lora(uri)
    assert result["status"] == "error"
    assert result["reason"] == reason
    assert message in result["message"]
    assert result["message"].startswith("Download failed: ")
    assert "secret" not in result["message"]
    assert "token@" not in result["message"]
    assert not (lora_env / "cache").exists()


async def test_digest_verification_for_local_adapters(lora_env: Path) -> None:
    source = write_tree(lora_env / "src", adapter_files())
    good = adapter_digest(source)
    manager = LoRAManager()
    uri = f"file://{source}"
    ok = await manager.download_lora_verified(uri, good)
    assert ok == {"status": "success", "local_path": str(source)}
    assert (await manager.download_lora_verified(uri, "sha256:" + good.upper()))["status"] == (
        "success"
    )
    wrong = await manager.download_lora_verified(uri, "0" * 64)
    assert wrong["status"] == "error"
    assert wrong["reason"] == "digest mismatch"
    assert f"the adapter has {good}" in wrong["message"]
    malformed = await manager.download_lora_verified(uri, "abc")
    assert malformed["reason"] == "bad digest"
    assert "64 hexadecimal digits" in malformed["message"]


class DirSource:
    """A custom source serving adapters from a local directory tree (`dir://name`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.downloads: list[tuple[str, Path]] = []
        self.active = 0
        self.max_active = 0

    async def exists(self, lora_uri: str) -> bool:
        return (self.root / lora_uri.split("://", 1)[1]).is_dir()

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(0)  # let other callers run while this one "downloads"
            write_tree(dest_path, read_tree(self.root / lora_uri.split("://", 1)[1]))
            self.downloads.append((lora_uri, dest_path))
            return dest_path
        finally:
            self.active -= 1


async def test_custom_source(lora_env: Path) -> None:
    source = DirSource(lora_env / "store")
    write_tree(source.root / "a", adapter_files())
    manager = LoRAManager()
    manager.register_custom_source("dir", source)
    missing = await manager.download_lora("dir://b")
    assert missing == {
        "status": "error",
        "message": "LoRA not found at dir://b",
        "reason": "not found",
    }
    result = await manager.download_lora("dir://a")
    expected_dest = lora_env / "cache" / "dir__a"
    assert result == {"status": "success", "local_path": str(expected_dest)}
    assert source.downloads == [("dir://a", expected_dest)]
    assert read_tree(expected_dest) == adapter_files()
    digest = adapter_digest(expected_dest)
    assert (await manager.download_lora_verified("dir://a", digest))["status"] == "success"
    assert (await manager.download_lora_verified("dir://a", "f" * 64))["reason"] == (
        "digest mismatch"
    )


async def test_custom_source_overrides_builtin_scheme_and_serialises(lora_env: Path) -> None:
    source = DirSource(lora_env / "store")
    write_tree(source.root / "org/repo", adapter_files())
    manager = LoRAManager()
    manager.register_custom_source("hf", source)
    results = await asyncio.gather(*(manager.download_lora("hf://org/repo") for _ in range(4)))
    assert all(r["status"] == "success" for r in results)
    assert source.max_active == 1  # one download per URI at a time


async def test_custom_source_errors_become_status_dicts(lora_env: Path) -> None:
    class Broken:
        async def exists(self, lora_uri: str) -> bool:
            return True

        async def download(self, lora_uri: str, dest_path: Path) -> Path:
            raise ConnectionError("registry unreachable")

    manager = LoRAManager()
    manager.register_custom_source("reg", Broken())
    result = await manager.download_lora("reg://x")
    assert result == {
        "status": "error",
        "message": "registry unreachable",
        "reason": "download failed",
    }


async def test_cancellation_propagates(lora_env: Path) -> None:
    started = asyncio.Event()

    class Hanging:
        async def exists(self, lora_uri: str) -> bool:
            return True

        async def download(self, lora_uri: str, dest_path: Path) -> Path:
            started.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    manager = LoRAManager()
    manager.register_custom_source("slow", Hanging())
    task = asyncio.create_task(manager.download_lora("slow://x"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The URI's lock was released: a second download of it proceeds.
    manager.register_custom_source("slow", DirSource(lora_env / "store"))
    write_tree(lora_env / "store" / "x", adapter_files())
    assert (await manager.download_lora("slow://x"))["status"] == "success"


def test_is_cached(lora_env: Path) -> None:
    manager = LoRAManager()
    assert not manager.is_cached("s3://b/lora")
    cached = write_tree(lora_env / "cache" / "s3__b_lora", adapter_files())
    assert not manager.is_cached("s3://b/lora")  # no completion marker: unfinished
    (cached / ".dynamo_lora_complete").write_bytes(b"1\n")
    assert manager.is_cached("s3://b/lora")
    with pytest.raises(RuntimeError, match="Cache lookup failed"):
        manager.is_cached("hf://a/b/c")
    before = snapshot_of(lora_env)
    assert not manager.is_cached("hf://org/repo")
    assert snapshot_of(lora_env) == before
