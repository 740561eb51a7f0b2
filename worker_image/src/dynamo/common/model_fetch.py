"""Fetch a model repository from the Hugging Face Hub into the local hub cache.

`fetch_model("org/repo")` returns the snapshot directory
(`<hub cache>/models--org--repo/snapshots/<sha>`). A cached snapshot is used without any
network request when it is complete enough to serve: `config.json`, a tokenizer
(`tokenizer.json`, `tiktoken.model` or any `*.tiktoken`) and, unless `ignore_weights`, the
weights (`model.safetensors`, `pytorch_model.bin`, or a sharded index whose every shard is
present). Otherwise every file of the `main` revision (weights skipped with
`ignore_weights`) is downloaded through `huggingface_hub`, and `refs/main` is written last.

Environment: `HF_HUB_OFFLINE` (no network; a cache miss is an error), `HF_TOKEN` (and the
usual token file), `HF_ENDPOINT`, the hub-cache variables (`HF_HUB_CACHE`, `HF_HOME`), and
`DYN_SNAPSHOT_CONTROL_DIR` (fetch in a short-lived child process, see
`fetch_model_in_subprocess`). Model Express (`MODEL_EXPRESS_URL`) is not supported in this
implementation: when it is set a warning is logged and the Hub is used directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import re
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Final

from dynamo.common.lora import hub_redirects
from dynamo.common.lora.adapter import atomic_write, safe_relative_path
from dynamo.common.lora.hf_source import hf_endpoint, hf_token, hub_cache_dir, offline

logger = logging.getLogger(__name__)

SNAPSHOT_CONTROL_ENV: Final = "DYN_SNAPSHOT_CONTROL_DIR"
REVISION: Final = "main"
TOKENIZER_FILES: Final = ("tokenizer.json", "tiktoken.model")
WEIGHT_FILES: Final = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES: Final = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Skipped with `ignore_weights`: weight files and their shard indexes.
WEIGHT_SUFFIXES: Final = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".safetensors.index.json",
    ".bin.index.json",
)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_CHILD_NAME: Final = "dynamo-model-fetch"


def is_complete_model(path: Path, ignore_weights: bool = False) -> bool:
    """True when `path` holds a config, a tokenizer and (unless `ignore_weights`) weights."""
    if not (path / "config.json").is_file():
        return False
    has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES) or any(
        path.glob("*.tiktoken")
    )
    if not has_tokenizer:
        return False
    return ignore_weights or _has_weights(path)


def _has_weights(path: Path) -> bool:
    if any((path / name).is_file() for name in WEIGHT_FILES):
        return True
    for index_name in WEIGHT_INDEXES:
        try:
            index = json.loads((path / index_name).read_text())
            shards = set(index["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if shards and all((path / shard).is_file() for shard in shards):
            return True
    return False


def cached_model(remote_name: str, ignore_weights: bool = False) -> Path | None:
    """The cached `main` snapshot of `remote_name` if it is complete, else None."""
    storage = hub_cache_dir() / ("models--" + remote_name.replace("/", "--"))
    try:
        commit = (storage / "refs" / REVISION).read_text().strip()
    except OSError:
        return None
    if not _COMMIT.fullmatch(commit):
        return None
    snapshot = storage / "snapshots" / commit
    return snapshot if is_complete_model(snapshot, ignore_weights) else None


def fetch_model_sync(remote_name: str, ignore_weights: bool = False) -> str:
    """Blocking body of `fetch_model` (what the child process runs)."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(remote_name)
    if os.environ.get("MODEL_EXPRESS_URL"):
        logger.warning("MODEL_EXPRESS_URL is set but Model Express is not supported; using the Hub")
    cached = cached_model(remote_name, ignore_weights)
    if cached is not None:
        return str(cached)
    if offline():
        raise RuntimeError(
            f"HF_HUB_OFFLINE is enabled and {remote_name} is not fully cached in "
            f"{hub_cache_dir()}; download it first or unset HF_HUB_OFFLINE"
        )
    hub_redirects.install(hf_endpoint)
    endpoint = hf_endpoint()
    token: str | bool = hf_token() or False
    info = HfApi(endpoint=endpoint, token=token).model_info(remote_name, revision=REVISION)
    commit = info.sha or ""
    if not _COMMIT.fullmatch(commit):
        raise RuntimeError(f"the Hub at {endpoint} returned no commit for {remote_name}")
    names = [sibling.rfilename for sibling in info.siblings or []]
    for name in names:
        safe_relative_path(name, remote_name)
    wanted = [n for n in names if not (ignore_weights and n.lower().endswith(WEIGHT_SUFFIXES))]
    cache_dir = hub_cache_dir()
    for name in wanted:
        hf_hub_download(
            remote_name,
            name,
            revision=commit,
            cache_dir=cache_dir,
            endpoint=endpoint,
            token=token,
        )
    storage = cache_dir / ("models--" + remote_name.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    atomic_write(storage / "refs" / REVISION, commit.encode())
    return str(snapshot)


async def fetch_model(remote_name: str, ignore_weights: bool = False) -> str:
    """Return the local snapshot directory of Hub model `remote_name`, downloading if needed.

    With `DYN_SNAPSHOT_CONTROL_DIR` set (process-snapshot mode) the download runs in a child
    process so this process opens no Hub connections of its own.
    """
    if os.environ.get(SNAPSHOT_CONTROL_ENV):
        return await fetch_model_in_subprocess(remote_name, ignore_weights)
    return await asyncio.to_thread(fetch_model_sync, remote_name, ignore_weights)


async def fetch_model_in_subprocess(remote_name: str, ignore_weights: bool = False) -> str:
    """Fetch a model in a short-lived process before snapshotting.

    The child (a `spawn` process named `dynamo-model-fetch`) sends `("ok", path)` or
    `("error", repr(exc))` over a one-way pipe. A non-zero exit or a missing result raises
    `RuntimeError("Model fetch subprocess failed for ...")`. Cancelling the caller
    terminates the child.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(
        target=_child_main, args=(sender, remote_name, ignore_weights), name=_CHILD_NAME
    )
    child.start()
    sender.close()  # the child holds the only writing end now
    try:
        await asyncio.to_thread(child.join)
    except asyncio.CancelledError:
        child.terminate()
        await asyncio.to_thread(child.join)
        raise
    finally:
        result = receiver.recv() if receiver.poll() else None
        receiver.close()
    if child.exitcode != 0 or result is None:
        raise RuntimeError(
            f"Model fetch subprocess failed for {remote_name}: exit code {child.exitcode}"
            + ("" if result is None else f", {result[1]}")
        )
    status, value = result
    if status != "ok":
        raise RuntimeError(f"Model fetch subprocess failed for {remote_name}: {value}")
    return str(value)


def _child_main(sender: Connection, remote_name: str, ignore_weights: bool) -> None:
    try:
        path = fetch_model_sync(remote_name, ignore_weights)
    except Exception as exc:
        sender.send(("error", repr(exc)))
    else:
        sender.send(("ok", path))
    finally:
        sender.close()
