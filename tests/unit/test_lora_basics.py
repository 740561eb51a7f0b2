"""OnceLock, LoRAInfo, get_lora_manager, the cache rules, adapter validation and the digest."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from pathlib import Path

import pytest

from dynamo.common.lora import (
    LoRADownloader,
    LoRAInfo,
    LoRAManager,
    OnceLock,
    adapter_digest,
    get_lora_manager,
)
from dynamo.common.lora import manager as manager_module
from dynamo.common.lora.adapter import (
    COMPLETE_MARKER,
    check_file_count,
    is_complete,
    max_adapter_files,
    safe_relative_path,
    validate_path,
)
from dynamo.common.lora.errors import REASON_UNSAFE, LoRADownloadError
from support.lora_adapters import adapter_files, lora_env, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


# -- OnceLock ----------------------------------------------------------------------------


def test_once_lock_initialises_once_under_contention() -> None:
    cell: OnceLock[object] = OnceLock()
    calls: list[int] = []
    start = threading.Barrier(8)
    results: list[object] = []

    def init() -> object:
        calls.append(1)
        return object()

    def worker() -> None:
        start.wait()
        results.append(cell.get_or_init(init))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert all(result is results[0] for result in results)
    assert cell.get() is results[0]


def test_once_lock_does_not_store_failures_or_none() -> None:
    cell: OnceLock[int] = OnceLock()
    assert cell.get() is None

    def fail() -> int:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        cell.get_or_init(fail)
    assert cell.get() is None
    none_calls: list[int] = []

    def give_none() -> int:
        none_calls.append(1)
        return None  # type: ignore[return-value]

    cell.get_or_init(give_none)
    cell.get_or_init(give_none)
    assert len(none_calls) == 2  # None is indistinguishable from "not initialised"
    assert cell.get_or_init(lambda: 7) == 7
    assert cell.get_or_init(fail) == 7


def test_lora_info_is_a_frozen_record() -> None:
    info = LoRAInfo(id=3, path="/x")
    assert (info.id, info.path) == (3, "/x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.id = 4  # type: ignore[misc]


# -- get_lora_manager ----------------------------------------------------------------------


@pytest.fixture
def fresh_singleton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "_lora_manager", OnceLock())


@pytest.mark.parametrize(
    ("value", "enabled"),
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("Yes", True),
        ("on", False),  # the Python parser does not accept "on"
        (" true", False),  # nor surrounding spaces
        ("", False),
        ("false", False),
        ("0", False),
    ],
)
def test_get_lora_manager_follows_dyn_lora_enabled(
    value: str,
    enabled: bool,
    lora_env: Path,
    fresh_singleton: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DYN_LORA_ENABLED", value)
    manager = get_lora_manager()
    assert (manager is not None) is enabled
    if enabled:
        assert isinstance(manager, LoRAManager)


def test_get_lora_manager_unset_is_none_then_singleton_survives_env_change(
    lora_env: Path, fresh_singleton: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert get_lora_manager() is None
    monkeypatch.setenv("DYN_LORA_ENABLED", "true")
    first = get_lora_manager()
    assert first is not None
    monkeypatch.setenv("DYN_LORA_ENABLED", "false")
    assert get_lora_manager() is first


def test_get_lora_manager_init_errors_propagate_and_retry(
    lora_env: Path, fresh_singleton: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_LORA_ENABLED", "1")
    attempts: list[int] = []
    real = manager_module._create_manager

    def failing_once() -> LoRAManager:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("cache volume not mounted")
        return real()

    monkeypatch.setattr(manager_module, "_create_manager", failing_once)
    with pytest.raises(OSError, match="not mounted"):
        get_lora_manager()
    assert isinstance(get_lora_manager(), LoRAManager)
    assert len(attempts) == 2


# -- cache root and key ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "key"),
    [
        ("s3://bucket/path/to/lora", "s3__bucket_path_to_lora"),
        ("file:///local/path", "file___local_path"),
        ("hf://org/repo@v1.0", "hf__org_repo@v1_0"),
        ("s3://b/a\\b/../c", "s3__b_a_b____c"),
        ("custom://x.y/z", "custom__x_y_z"),
    ],
)
def test_uri_to_cache_key(uri: str, key: str) -> None:
    assert LoRADownloader.uri_to_cache_key(uri) == key
    assert LoRAManager._uri_to_cache_key(uri) == key


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DYN_LORA_PATH", "HOME", "USERPROFILE"):
        monkeypatch.delenv(name, raising=False)
    assert LoRADownloader().cache_root == Path("/tmp/.cache/dynamo_loras")
    monkeypatch.setenv("USERPROFILE", str(tmp_path / "profile"))
    assert LoRADownloader().cache_root == tmp_path / "profile/.cache/dynamo_loras"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert LoRADownloader().cache_root == tmp_path / "home/.cache/dynamo_loras"
    monkeypatch.setenv("DYN_LORA_PATH", str(tmp_path / "env"))
    assert LoRADownloader().cache_root == tmp_path / "env"
    explicit = LoRADownloader(str(tmp_path / "arg"))
    assert explicit.cache_root == tmp_path / "arg"
    assert explicit.get_cache_path("k") == str(tmp_path / "arg" / "k")
    assert LoRAManager(tmp_path / "m").downloader.cache_root == tmp_path / "m"
    # Nothing is created until a download needs it.
    assert not (tmp_path / "arg").exists()
    assert not (tmp_path / "env").exists()


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "valid"),
    [
        (["adapter_config.json", "adapter_model.safetensors"], True),
        (["adapter_config.json", "adapter_model.bin"], True),
        (["adapter_config.json", "model.lora_weights.npy"], True),
        (["adapter_config.json"], False),
        (["adapter_model.safetensors"], False),
        (["adapter_config.json", "model.safetensors"], False),
        ([], False),
    ],
)
def test_validate_path(tmp_path: Path, names: list[str], valid: bool) -> None:
    write_tree(tmp_path / "a", {name: b"x" for name in names})
    (tmp_path / "a").mkdir(exist_ok=True)
    assert validate_path(tmp_path / "a") is valid
    assert not validate_path(tmp_path / "missing")


def test_is_complete_needs_the_exact_marker(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "a", adapter_files())
    assert validate_path(root)
    assert not is_complete(root)
    (root / COMPLETE_MARKER).write_bytes(b"1")
    assert not is_complete(root)
    (root / COMPLETE_MARKER).write_bytes(b"1\n")
    assert is_complete(root)
    downloader = LoRADownloader(str(tmp_path))
    assert downloader.validate_cached("a")
    assert not downloader.validate_cached("b")


# -- digest --------------------------------------------------------------------------------


def _reference_digest(files: dict[str, bytes]) -> str:
    """The documented definition, written out independently of the implementation."""
    digest = hashlib.sha256()
    for name in sorted(files, key=lambda n: n.encode()):
        raw = name.encode()
        content = files[name]
        digest.update(len(raw).to_bytes(8, "big") + raw + len(content).to_bytes(8, "big"))
        digest.update(content)
    return digest.hexdigest()


def test_adapter_digest_matches_the_documented_definition(tmp_path: Path) -> None:
    files = adapter_files() | {"sub/dir/notes.txt": b"hello", "Z.bin": b"", "a.txt": b"z"}
    root = write_tree(tmp_path / "a", files)
    assert adapter_digest(root) == _reference_digest(files)
    # Bookkeeping files at the top level are not part of the adapter.
    (root / COMPLETE_MARKER).write_bytes(b"1\n")
    (root / ".dynamo_lora_sha256").write_text("x")
    assert adapter_digest(root) == _reference_digest(files)
    # Any change of a name or a byte changes the digest.
    (root / "a.txt").write_bytes(b"y")
    assert adapter_digest(root) != _reference_digest(files)


def test_adapter_digest_frames_names_and_contents(tmp_path: Path) -> None:
    # Same concatenated bytes, different split between name and content.
    one = write_tree(tmp_path / "one", {"ab": b"c"})
    two = write_tree(tmp_path / "two", {"a": b"bc"})
    assert adapter_digest(one) != adapter_digest(two)


# -- names from listings -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "is empty"),
        ("../x", "'..'"),
        ("a/../../x", "'..'"),
        ("a/./b", "'.'"),
        ("a//b", "empty"),
        ("/etc/passwd", "is absolute"),
        ("C:evil", "is absolute"),
        ("a\\..\\b", "backslash"),
        ("a\x00b", "NUL"),
        (".dynamo_lora_complete", "reserved"),
        ("sub/.DYNAMO_LORA_sha256", "reserved"),
    ],
)
def test_safe_relative_path_refuses(name: str, problem: str) -> None:
    with pytest.raises(LoRADownloadError, match=problem) as caught:
        safe_relative_path(name, "s3://b/p")
    assert caught.value.reason == REASON_UNSAFE
    assert "s3://b/p" in str(caught.value)


def test_safe_relative_path_accepts_nested_names() -> None:
    assert safe_relative_path("a/b.c/d", "x").parts == ("a", "b.c", "d")


def test_max_files_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_LORA_MAX_FILES", raising=False)
    assert max_adapter_files() == 1000
    check_file_count(1000, "x")
    with pytest.raises(LoRADownloadError, match="1001 files, more than the limit of 1000"):
        check_file_count(1001, "x")
    monkeypatch.setenv("DYN_LORA_MAX_FILES", "3")
    with pytest.raises(LoRADownloadError, match="raise DYN_LORA_MAX_FILES"):
        check_file_count(4, "x")
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("DYN_LORA_MAX_FILES", bad)
        with pytest.raises(ValueError, match="DYN_LORA_MAX_FILES"):
            max_adapter_files()
