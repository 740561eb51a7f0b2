"""`fetch_model` and `fetch_model_in_subprocess` against a local Hub imitation."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo.common.model_fetch import (
    fetch_model,
    fetch_model_in_subprocess,
    is_complete_model,
)
from support.fake_hf_hub import FakeHub, running_hub
from support.lora_adapters import lora_env, read_tree, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]

MODEL = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "model.safetensors": b"weights" * 100,
    "README.md": b"# tiny",
}


@pytest.fixture
def hub(lora_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with running_hub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def storage(lora_env: Path, repo_id: str) -> Path:
    return lora_env / "hf" / ("models--" + repo_id.replace("/", "--"))


async def test_fetch_then_cache_hit(
    hub: FakeHub, lora_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = hub.add_commit("org/tiny", MODEL)
    path = await fetch_model("org/tiny")
    assert path == str(storage(lora_env, "org/tiny") / "snapshots" / sha)
    assert read_tree(Path(path)) == MODEL
    assert (storage(lora_env, "org/tiny") / "refs" / "main").read_text() == sha

    requests = len(hub.requests)
    assert await fetch_model("org/tiny") == path
    assert len(hub.requests) == requests  # a complete cached snapshot needs no network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert await fetch_model("org/tiny") == path


async def test_ignore_weights_skips_weight_files(hub: FakeHub) -> None:
    hub.add_commit("org/tiny", MODEL | {"model-00001-of-00002.safetensors": b"w"})
    path = Path(await fetch_model("org/tiny", ignore_weights=True))
    assert set(read_tree(path)) == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    }
    assert hub.count("GET", ".safetensors") == 0
    # Without ignore_weights the same snapshot is not complete: the weights are fetched.
    full = Path(await fetch_model("org/tiny"))
    assert full == path
    assert (full / "model.safetensors").is_file()


async def test_offline_miss_is_an_error(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_commit("org/tiny", MODEL)
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE is enabled and org/tiny is not fully"):
        await fetch_model("org/tiny")
    assert hub.requests == []


async def test_incomplete_cached_snapshot_is_completed(hub: FakeHub, lora_env: Path) -> None:
    sha = hub.add_commit("org/tiny", MODEL)
    snapshot = storage(lora_env, "org/tiny") / "snapshots" / sha
    write_tree(snapshot, {"config.json": MODEL["config.json"]})  # no tokenizer, no weights
    write_tree(storage(lora_env, "org/tiny") / "refs", {"main": sha.encode()})
    assert await fetch_model("org/tiny") == str(snapshot)
    assert read_tree(snapshot) == MODEL


@pytest.mark.parametrize(
    ("files", "ignore_weights", "complete"),
    [
        (MODEL, False, True),
        ({"config.json": b"{}", "tokenizer.json": b"{}"}, True, True),
        ({"config.json": b"{}", "tokenizer.json": b"{}"}, False, False),
        ({"config.json": b"{}", "tiktoken.model": b"", "pytorch_model.bin": b""}, False, True),
        ({"config.json": b"{}", "cl100k.tiktoken": b"", "model.safetensors": b""}, False, True),
        ({"config.json": b"{}", "model.safetensors": b""}, False, False),
        ({"tokenizer.json": b"{}", "model.safetensors": b""}, False, False),
    ],
)
def test_cache_hit_rules(
    tmp_path: Path, files: dict[str, bytes], ignore_weights: bool, complete: bool
) -> None:
    assert is_complete_model(write_tree(tmp_path / "m", files), ignore_weights) is complete


def test_sharded_index_must_be_complete(tmp_path: Path) -> None:
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    files = {
        "config.json": b"{}",
        "tokenizer.json": b"{}",
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-1.safetensors": b"",
    }
    root = write_tree(tmp_path / "m", files)
    assert not is_complete_model(root)
    (root / "model-2.safetensors").write_bytes(b"")
    assert is_complete_model(root)
    (root / "model.safetensors.index.json").write_text("not json")
    assert not is_complete_model(root)


async def test_unsafe_file_names_are_refused(hub: FakeHub, lora_env: Path) -> None:
    hub.add_commit("org/evil", MODEL, listed_only=["../../escape"])
    with pytest.raises(RuntimeError, match=re.escape("refusing file name '../../escape'")):
        await fetch_model("org/evil")
    assert not (lora_env / "escape").exists()


async def test_in_subprocess(hub: FakeHub, lora_env: Path) -> None:
    sha = hub.add_commit("org/tiny", MODEL)
    path = await fetch_model_in_subprocess("org/tiny")
    assert path == str(storage(lora_env, "org/tiny") / "snapshots" / sha)
    assert read_tree(Path(path)) == MODEL
    with pytest.raises(
        RuntimeError, match=r"Model fetch subprocess failed for org/missing: .*RepositoryNotFound"
    ):
        await fetch_model_in_subprocess("org/missing")


async def test_snapshot_mode_fetches_in_a_child(
    hub: FakeHub, lora_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_SNAPSHOT_CONTROL_DIR", str(lora_env / "ctl"))
    sha = hub.add_commit("org/tiny", MODEL)
    path = await fetch_model("org/tiny")
    assert path.endswith(f"snapshots/{sha}")
    # Errors carry the child's prefix, which only the subprocess path produces.
    with pytest.raises(RuntimeError, match="Model fetch subprocess failed for org/nope"):
        await fetch_model("org/nope")
