"""`s3://` adapters against a real moto S3 server on loopback."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from dynamo.common.lora import LoRAManager, adapter_digest, s3_source
from dynamo.common.lora.s3_source import with_retries
from support.lora_adapters import adapter_files, lora_env, read_tree, write_tree
from support.s3 import S3Server

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


@pytest.fixture
def s3(lora_env: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    # Keep the three attempts, shorten the waits between them (1 s and 2 s in production).
    monkeypatch.setattr(s3_source, "RETRY_DELAYS", (0.01, 0.01))
    return s3_server


@pytest.fixture
def closed_port() -> str:
    """An endpoint on loopback where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def cache_entries(root: Path) -> set[str]:
    return {entry.name for entry in root.iterdir()} if root.exists() else set()


async def test_cold_then_warm_download(
    s3: S3Server, lora_env: Path, closed_port: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3.new_bucket()
    files = adapter_files() | {"nested/dir/tokenizer.json": b"{}", "README.md": b"# lora"}
    s3.put_files(bucket, "loras/mine", files)
    uri = f"s3://{bucket}/loras/mine"
    manager = LoRAManager()
    assert not manager.is_cached(uri)

    result = await manager.download_lora(uri)
    key = f"s3__{bucket}_loras_mine"
    dest = lora_env / "cache" / key
    assert result == {"status": "success", "local_path": str(dest)}
    assert read_tree(dest) == files | {".dynamo_lora_complete": b"1\n"}
    assert manager.is_cached(uri)
    # Only the entry and its lock file remain: no temp dirs.
    assert cache_entries(lora_env / "cache") == {key, f"{key}.lock"}

    # Warm: served from the cache without contacting S3 (the endpoint now refuses).
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed_port)
    assert await manager.download_lora(uri) == result
    # A trailing slash names the same objects but is a different cache key.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    assert (await manager.download_lora(uri + "/"))["status"] == "success"


async def test_folder_placeholder_objects_are_skipped(s3: S3Server, lora_env: Path) -> None:
    bucket = s3.new_bucket()
    s3.put_files(bucket, "p", adapter_files())
    s3.client().put_object(Bucket=bucket, Key="p/folder/", Body=b"")
    result = await LoRAManager().download_lora(f"s3://{bucket}/p")
    assert result["status"] == "success"
    assert set(read_tree(Path(result["local_path"]))) == set(adapter_files()) | {
        ".dynamo_lora_complete"
    }


async def test_prefix_is_a_directory_not_a_string_prefix(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    s3.put_files(bucket, "lora-other", adapter_files())
    result = await LoRAManager().download_lora(f"s3://{bucket}/lora")
    assert result["reason"] == "not found"
    assert f"no objects found under s3://{bucket}/lora" in result["message"]


async def test_missing_bucket_is_not_found(s3: S3Server, lora_env: Path) -> None:
    result = await LoRAManager().download_lora("s3://no-such-bucket-4a1f/lora")
    assert result["status"] == "error"
    assert result["reason"] == "not found"
    assert "s3://no-such-bucket-4a1f/lora" in result["message"]


async def test_missing_credentials(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = await LoRAManager().download_lora("s3://bucket/lora")
    assert result["reason"] == "auth"
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in result["message"]


async def test_plain_http_endpoint_needs_allow_http(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    result = await LoRAManager().download_lora("s3://bucket/lora")
    assert result["reason"] == "bad uri"
    assert "set AWS_ALLOW_HTTP=true" in result["message"]


async def test_upstream_endpoint_variable_wins(
    s3: S3Server, closed_port: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3.new_bucket()
    s3.put_files(bucket, "p", adapter_files())
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed_port)
    monkeypatch.setenv("AWS_ENDPOINT", s3.endpoint_url)
    assert (await LoRAManager().download_lora(f"s3://{bucket}/p"))["status"] == "success"


async def test_unreachable_endpoint(
    s3: S3Server, lora_env: Path, closed_port: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed_port)
    result = await LoRAManager().download_lora("s3://bucket/lora")
    assert result["reason"] == "download failed"
    assert f"cannot reach the S3 endpoint {closed_port}" in result["message"]
    assert cache_entries(lora_env / "cache") <= {"s3__bucket_lora.lock"}


async def test_timeout(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # A listener that accepts connections but never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("LORA_DOWNLOAD_TIMEOUT_SECS", "0.2")
        result = await LoRAManager().download_lora("s3://bucket/lora")
    assert result["reason"] == "timeout"
    assert "raise LORA_DOWNLOAD_TIMEOUT_SECS" in result["message"]


async def test_invalid_adapter_is_not_published(s3: S3Server, lora_env: Path) -> None:
    bucket = s3.new_bucket()
    s3.put_files(bucket, "p", {"adapter_model.safetensors": b"x", "notes.txt": b"y"})
    result = await LoRAManager().download_lora(f"s3://{bucket}/p")
    assert result["reason"] == "invalid adapter"
    assert "has no adapter_config.json" in result["message"]
    assert cache_entries(lora_env / "cache") == {f"s3__{bucket}_p.lock"}


async def test_unfinished_entry_is_replaced(s3: S3Server, lora_env: Path) -> None:
    bucket = s3.new_bucket()
    s3.put_files(bucket, "p", adapter_files())
    key = f"s3__{bucket}_p"
    # A directory left by an interrupted download (no completion marker) and a stale temp dir.
    write_tree(lora_env / "cache" / key, {"adapter_config.json": b"partial"})
    write_tree(lora_env / "cache" / f"{key}.tmp.1.2", {"junk": b"x"})
    manager = LoRAManager()
    assert not manager.is_cached(f"s3://{bucket}/p")
    result = await manager.download_lora(f"s3://{bucket}/p")
    assert result["status"] == "success"
    cached = read_tree(lora_env / "cache" / key)
    assert cached["adapter_config.json"] == adapter_files()["adapter_config.json"]
    assert cache_entries(lora_env / "cache") == {key, f"{key}.lock"}


async def test_digest_checks(s3: S3Server, lora_env: Path) -> None:
    bucket = s3.new_bucket()
    s3.put_files(bucket, "p", adapter_files(seed=1))
    uri = f"s3://{bucket}/p"
    key = f"s3__{bucket}_p"
    manager = LoRAManager()
    reference = write_tree(lora_env / "ref1", adapter_files(seed=1))
    digest_v1 = adapter_digest(reference)

    wrong = await manager.download_lora_verified(uri, "ab" * 32)
    assert wrong["reason"] == "digest mismatch"
    assert f"expected sha256 {'ab' * 32}, the adapter has {digest_v1}" in wrong["message"]
    assert cache_entries(lora_env / "cache") == {f"{key}.lock"}  # nothing published

    ok = await manager.download_lora_verified(uri, digest_v1)
    assert ok["status"] == "success"
    assert (lora_env / "cache" / key / ".dynamo_lora_sha256").read_text() == digest_v1

    # The source gets a new adapter under the same URI: asking for its digest re-fetches it;
    # asking for the old one keeps serving the cached copy.
    s3.put_files(bucket, "p", adapter_files(seed=2))
    digest_v2 = adapter_digest(write_tree(lora_env / "ref2", adapter_files(seed=2)))
    assert (await manager.download_lora_verified(uri, digest_v1))["status"] == "success"
    again = await manager.download_lora_verified(uri, digest_v2)
    assert again == ok
    weights = read_tree(lora_env / "cache" / key)["adapter_model.safetensors"]
    assert weights == adapter_files(seed=2)["adapter_model.safetensors"]
    assert cache_entries(lora_env / "cache") == {key, f"{key}.lock"}


async def test_retries_transient_failures_only() -> None:
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert await with_retries(flaky, what="x", delays=(0.0, 0.0)) == "ok"
    assert len(calls) == 3

    calls.clear()

    async def always_failing() -> str:
        calls.append(1)
        raise ConnectionResetError("reset by peer")

    with pytest.raises(ConnectionResetError):
        await with_retries(always_failing, what="x", delays=(0.0, 0.0))
    assert len(calls) == 3  # three attempts in all

    calls.clear()

    async def missing() -> str:
        calls.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        await with_retries(missing, what="x", delays=(0.0, 0.0))
    assert len(calls) == 1


async def test_concurrent_callers_in_one_process_download_once(
    s3: S3Server, lora_env: Path
) -> None:
    bucket = s3.new_bucket()
    s3.put_files(bucket, "p", adapter_files())
    manager = LoRAManager()
    results = await asyncio.gather(*(manager.download_lora(f"s3://{bucket}/p") for _ in range(6)))
    assert {r["status"] for r in results} == {"success"}
    assert len({r["local_path"] for r in results}) == 1
