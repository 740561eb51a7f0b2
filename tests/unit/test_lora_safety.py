"""Hostile sources are refused with a clear message and nothing is written outside the
cache root (and nothing but lock files inside it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dynamo.common.lora import LoRAManager, s3_source
from support.fake_hf_hub import FakeHub, running_hub
from support.lora_adapters import adapter_files, lora_env, snapshot_of, write_tree
from support.s3 import S3Server

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


@dataclass
class Sources:
    """Where a case can place its hostile adapter."""

    s3: S3Server
    bucket: str
    hub: FakeHub
    local: Path

    def put(self, prefix: str, files: dict[str, bytes]) -> str:
        client = self.s3.client()
        for name, content in files.items():
            client.put_object(Bucket=self.bucket, Key=f"{prefix}/{name}", Body=content)
        return f"s3://{self.bucket}/{prefix}"

    def put_keys(self, keys: dict[str, bytes]) -> None:
        client = self.s3.client()
        for key, content in keys.items():
            client.put_object(Bucket=self.bucket, Key=key, Body=content)


@pytest.fixture
def sources(
    lora_env: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Sources]:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setattr(s3_source, "RETRY_DELAYS", (0.01, 0.01))
    with running_hub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield Sources(s3_server, s3_server.new_bucket("hostile"), hub, lora_env / "local")


def s3_traversal(src: Sources) -> str:
    return src.put("p", adapter_files() | {"../outside.txt": b"x"})


def s3_deep_traversal(src: Sources) -> str:
    return src.put("p", adapter_files() | {"a/../../outside.txt": b"x"})


def s3_absolute(src: Sources) -> str:
    # Key "p//etc/cron.d/x": after the prefix "p/" the name is "/etc/cron.d/x".
    return src.put("p", adapter_files() | {"/etc/cron.d/x": b"x"})


def s3_backslash(src: Sources) -> str:
    return src.put("p", adapter_files() | {"a\\..\\..\\x": b"x"})


def s3_marker(src: Sources) -> str:
    return src.put("p", {"adapter_config.json": b"{}", ".dynamo_lora_complete": b"1\n"})


def s3_file_and_dir(src: Sources) -> str:
    return src.put("p", adapter_files() | {"a": b"x", "a/b": b"y"})


def s3_too_many(src: Sources) -> str:
    return src.put("p", adapter_files() | {f"f{i}.txt": b"x" for i in range(9)})


def s3_empty_prefix(src: Sources) -> str:
    src.put_keys({"adapter_config.json": b"{}", "adapter_model.safetensors": b"x"})
    return f"s3://{src.bucket}"


def s3_prefix_traversal(src: Sources) -> str:
    src.put("x", adapter_files())
    return f"s3://{src.bucket}/p/../x"


def hf_names(*names: str) -> Callable[[Sources], str]:
    def make(src: Sources) -> str:
        src.hub.add_commit("org/evil", adapter_files(), listed_only=list(names))
        return "hf://org/evil"

    return make


def hf_too_many(src: Sources) -> str:
    src.hub.add_commit("org/many", adapter_files() | {f"f{i}": b"x" for i in range(9)})
    return "hf://org/many"


def local_symlink(src: Sources) -> str:
    root = write_tree(src.local / "adapter", adapter_files())
    (root / "weights").symlink_to(src.local.parent / "secret")
    (src.local.parent / "secret").write_text("private")
    return f"file://{root}"


def local_dir_symlink(src: Sources) -> str:
    root = write_tree(src.local / "adapter", adapter_files())
    (root / "etc").symlink_to("/etc")
    return f"file://{root}"


def wrong_scheme(src: Sources) -> str:
    return "gopher://example/lora"


def uppercase_scheme(src: Sources) -> str:
    return f"S3://{src.bucket}/p"


CASES: list[tuple[str, Callable[[Sources], str], str, str]] = [
    ("s3 ../", s3_traversal, "unsafe source", "'..'"),
    ("s3 a/../../", s3_deep_traversal, "unsafe source", "'..'"),
    ("s3 absolute", s3_absolute, "unsafe source", "is absolute"),
    ("s3 backslash", s3_backslash, "unsafe source", "backslash"),
    ("s3 marker", s3_marker, "unsafe source", "reserved"),
    ("s3 file+dir", s3_file_and_dir, "unsafe source", "both an object and a directory"),
    ("s3 file count", s3_too_many, "unsafe source", "more than the limit of 10"),
    ("s3 empty prefix", s3_empty_prefix, "bad uri", "empty prefix"),
    ("s3 prefix ..", s3_prefix_traversal, "bad uri", "'..'"),
    ("hf ../", hf_names("../escape.txt"), "unsafe source", "'..'"),
    ("hf nested ..", hf_names("sub/../../escape.txt"), "unsafe source", "'..'"),
    ("hf absolute", hf_names("/tmp/escape.txt"), "unsafe source", "is absolute"),
    ("hf marker", hf_names(".DYNAMO_LORA_COMPLETE"), "unsafe source", "reserved"),
    ("hf file count", hf_too_many, "unsafe source", "more than the limit of 10"),
    ("file symlink", local_symlink, "unsafe source", "outside the adapter directory"),
    ("file dir symlink", local_dir_symlink, "unsafe source", "outside the adapter directory"),
    ("wrong scheme", wrong_scheme, "bad uri", "unsupported LoRA URI scheme 'gopher'"),
    ("uppercase scheme", uppercase_scheme, "bad uri", "unsupported LoRA URI scheme 'S3'"),
]


@pytest.mark.parametrize(
    ("make", "reason", "message"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_hostile_source_is_refused(
    sources: Sources,
    lora_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[Sources], str],
    reason: str,
    message: str,
) -> None:
    monkeypatch.setenv("DYN_LORA_MAX_FILES", "10")
    uri = make(sources)
    before = snapshot_of(lora_env)
    manager = LoRAManager()
    result = await manager.download_lora(uri)
    assert result["status"] == "error", result
    assert result["reason"] == reason
    assert message in result["message"]
    assert "local_path" not in result

    cache = lora_env / "cache"
    created = snapshot_of(lora_env) - before
    assert {path for path in created if not path.startswith("cache")} == set()
    assert {path for path in created if path.startswith("cache/")} <= {
        f"cache/{manager.downloader.uri_to_cache_key(uri)}.lock"
    }
    assert not manager.is_cached(uri)
    # The traversal targets themselves were never created.
    assert not (cache.parent / "outside.txt").exists()
    assert not (lora_env / "escape.txt").exists()
