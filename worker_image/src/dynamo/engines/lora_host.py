"""`LoRAAdapterHost`: the engine side of run-time LoRA management.

An engine that serves LoRA adapters owns one host and exposes it through its engine updates:
`supported_updates()` includes `LORA_UPDATES` and `engine_update(name, body)` hands those
names to `host.handle(name, body)`. The runtime's `/v1/loras` routes forward to exactly
these updates. The host does the bookkeeping every engine would otherwise repeat: request
validation, one operation per adapter name at a time, downloads through `LoRAManager`
(optionally verified against a sha256), idempotent re-loads (the operator retries), hot
swaps, the capacity bound and stable adapter ids. The engine supplies two callbacks that
touch its weights:

* `load(name, lora_id, path)`: make the adapter in `path` servable under `name`. It is also
  called for a name that is already loaded (a hot swap, when the URI or digest changed): the
  engine must then replace the adapter in place, so requests never see the name missing.
  If it raises, the previous version stays loaded and recorded.
* `unload(name, lora_id)`: drop the adapter.

Responses follow upstream's engine handler contract (status dicts with `status`, `message`,
`lora_name`, `lora_id`); error responses add a machine-readable `reason` and successful
loads add `downloaded_bytes` (0 for cached or `file://` adapters) for the runtime's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import blake3

from dynamo.common.backend import LLMEngine
from dynamo.common.lora import LoRAManager, get_lora_manager
from dynamo.common.rl import (
    RLAdminValidationError,
    require_lora_load_request,
    require_lora_unload_request,
)
from dynamo.runtime.errors import RequestError

logger = logging.getLogger(__name__)

LORA_UPDATES: Final = frozenset({"load_lora", "unload_lora", "list_loras"})

# `reason` values of error responses that do not come from the downloader (whose reasons
# are dynamo.common.lora.errors.REASON_*).
REASON_BAD_REQUEST: Final = "bad request"
REASON_CAPACITY: Final = "capacity"
REASON_UNAVAILABLE: Final = "unavailable"
REASON_ENGINE: Final = "engine"
REASON_NOT_LOADED: Final = "not loaded"

LoadCallback = Callable[[str, int, Path], Awaitable[None]]
UnloadCallback = Callable[[str, int], Awaitable[None]]


def lora_name_to_id(name: str) -> int:
    """Upstream's stable adapter id: 31 bits of blake3(name), never 0.

    The first 8 bytes of the digest read as a big-endian u64, masked to 31 bits; 0 maps to 1
    because engines reserve id 0 for "no adapter".
    """
    prefix = blake3.blake3(name.encode()).digest()[:8]
    value = int.from_bytes(prefix, "big") & 0x7FFFFFFF
    return value or 1


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter the engine serves: its id, where it came from and its local files."""

    lora_id: int
    uri: str
    path: Path
    # The digest the load was verified against, if the caller gave one.
    sha256: str | None = None


def _source(adapter: LoadedAdapter) -> dict[str, str]:
    """The source a load request named (the digest only when it gave one)."""
    source = {"uri": adapter.uri}
    if adapter.sha256 is not None:
        source["sha256"] = adapter.sha256
    return source


def _error(message: str, reason: str, lora_name: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"status": "error", "message": message, "reason": reason}
    if lora_name is not None:
        body["lora_name"] = lora_name
    return body


def _tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue
    return total


class LoRAAdapterHost:
    """Validates, downloads and tracks LoRA adapters for one engine (see the module doc)."""

    def __init__(
        self,
        *,
        max_loras: int,
        load: LoadCallback,
        unload: UnloadCallback,
        manager: LoRAManager | None = None,
    ) -> None:
        """`manager` None means `get_lora_manager()` at each load (None unless
        `DYN_LORA_ENABLED` is true, as upstream)."""
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        self._max_loras = max_loras
        self._load = load
        self._unload = unload
        self._manager = manager
        self._loaded: dict[str, LoadedAdapter] = {}
        # Names whose first load is in progress: they hold a capacity slot already.
        self._pending: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def max_loras(self) -> int:
        """How many adapters may be loaded at once."""
        return self._max_loras

    def loaded(self) -> dict[str, LoadedAdapter]:
        """The loaded adapters by name (a copy)."""
        return dict(self._loaded)

    async def handle(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Answer one of the `LORA_UPDATES` engine updates with a status dict."""
        if name == "load_lora":
            return await self._handle_load(body)
        if name == "unload_lora":
            return await self._handle_unload(body)
        if name == "list_loras":
            return self.list_response()
        return {"status": "error", "message": f"unsupported engine update: {name}"}

    def list_response(self) -> dict[str, Any]:
        """`{"status": "success", "loras": {name: id}, "count": n, "sources": {name: {"uri":
        ..., "sha256": ...}}}`: upstream's answer, plus where each adapter came from (the
        operator verifies a pod serves the current source without loading it again)."""
        adapters = sorted(self._loaded.items())
        loras = {name: adapter.lora_id for name, adapter in adapters}
        sources = {name: _source(adapter) for name, adapter in adapters}
        return {"status": "success", "loras": loras, "count": len(loras), "sources": sources}

    def _lock(self, lora_name: str) -> asyncio.Lock:
        return self._locks.setdefault(lora_name, asyncio.Lock())

    async def _handle_load(self, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            lora_name, uri = require_lora_load_request(body)
            sha256 = _optional_sha256(body)
        except RLAdminValidationError as exc:
            return _error(str(exc), REASON_BAD_REQUEST)
        async with self._lock(lora_name):
            return await self._load_locked(lora_name, uri, sha256)

    async def _load_locked(self, lora_name: str, uri: str, sha256: str | None) -> dict[str, Any]:
        lora_id = lora_name_to_id(lora_name)
        current = self._loaded.get(lora_name)
        if current is not None and current.uri == uri and sha256 in (None, current.sha256):
            return {
                "status": "success",
                "message": f"LoRA adapter '{lora_name}' already loaded",
                "lora_name": lora_name,
                "lora_id": current.lora_id,
                "hot_swap": False,
                "downloaded_bytes": 0,
            }
        hot_swap = current is not None
        if not hot_swap and len(self._loaded) + len(self._pending) >= self._max_loras:
            return _error(
                f"LoRA capacity exceeded: at most {self._max_loras} adapter(s) may be loaded",
                REASON_CAPACITY,
                lora_name,
            )
        manager = self._manager or get_lora_manager()
        if manager is None:
            return _error(
                "LoRAManager not initialized. Set DYN_LORA_ENABLED=true to enable URI-based "
                "LoRA loading.",
                REASON_UNAVAILABLE,
                lora_name,
            )
        if not hot_swap:
            self._pending.add(lora_name)
        try:
            return await self._fetch_and_load(manager, lora_name, lora_id, uri, sha256, hot_swap)
        finally:
            self._pending.discard(lora_name)

    async def _fetch_and_load(
        self,
        manager: LoRAManager,
        lora_name: str,
        lora_id: int,
        uri: str,
        sha256: str | None,
        hot_swap: bool,
    ) -> dict[str, Any]:
        was_local = uri.startswith("file://") or _is_cached(manager, uri)
        if sha256 is None:
            result = await manager.download_lora(uri)
        else:
            result = await manager.download_lora_verified(uri, sha256)
        if result.get("status") != "success":
            message = str(result.get("message", "unknown error"))
            reason = str(result.get("reason", "download failed"))
            return _error(f"Failed to download LoRA: {message}", reason, lora_name)
        path = Path(result["local_path"])
        try:
            await self._load(lora_name, lora_id, path)
        except Exception as exc:
            logger.exception("engine failed to load LoRA adapter %r from %s", lora_name, path)
            return _error(
                f"Failed to load LoRA adapter '{lora_name}': {exc}", REASON_ENGINE, lora_name
            )
        self._loaded[lora_name] = LoadedAdapter(lora_id=lora_id, uri=uri, path=path, sha256=sha256)
        downloaded = 0 if was_local else await asyncio.to_thread(_tree_size, path)
        verb = "hot-swapped" if hot_swap else "loaded"
        logger.info("LoRA adapter %r %s from %s (id %d)", lora_name, verb, uri, lora_id)
        return {
            "status": "success",
            "message": f"LoRA adapter '{lora_name}' {verb} successfully",
            "lora_name": lora_name,
            "lora_id": lora_id,
            "hot_swap": hot_swap,
            "downloaded_bytes": downloaded,
        }

    async def _handle_unload(self, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            lora_name = require_lora_unload_request(body)
        except RLAdminValidationError as exc:
            return _error(str(exc), REASON_BAD_REQUEST)
        async with self._lock(lora_name):
            current = self._loaded.get(lora_name)
            if current is None:
                available = sorted(self._loaded)
                return _error(
                    f"LoRA adapter '{lora_name}' not found. Available LoRAs: {available}",
                    REASON_NOT_LOADED,
                    lora_name,
                )
            try:
                await self._unload(lora_name, current.lora_id)
            except Exception as exc:
                logger.exception("engine failed to unload LoRA adapter %r", lora_name)
                return _error(
                    f"Failed to unload LoRA adapter '{lora_name}': {exc}", REASON_ENGINE, lora_name
                )
            del self._loaded[lora_name]
        logger.info("LoRA adapter %r unloaded", lora_name)
        return {
            "status": "success",
            "message": f"LoRA adapter '{lora_name}' unloaded successfully",
            "lora_name": lora_name,
            "lora_id": current.lora_id,
        }


def _optional_sha256(body: Mapping[str, Any]) -> str | None:
    """`source.sha256` when present; it must be a string (the downloader checks its form)."""
    value = body["source"].get("sha256")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RLAdminValidationError("'source.sha256' must be a string of 64 hexadecimal digits")
    return value


def _is_cached(manager: LoRAManager, uri: str) -> bool:
    try:
        return manager.is_cached(uri)
    except Exception:
        # An unparseable URI: the download reports the error properly.
        return False


class LoRAHostEngine(LLMEngine):
    """An `LLMEngine` that serves LoRA adapters through a `LoRAAdapterHost`.

    The engine supplies the two callbacks that touch its weights; this class owns the host
    and wires the engine updates to it.
    """

    def __init__(self, *, max_loras: int, lora_manager: LoRAManager | None) -> None:
        """`lora_manager` None means `get_lora_manager()` at each load."""
        self.lora_host = LoRAAdapterHost(
            max_loras=max_loras,
            load=self._load_adapter,
            unload=self._unload_adapter,
            manager=lora_manager,
        )

    @abstractmethod
    async def _load_adapter(self, name: str, lora_id: int, path: Path) -> None:
        """Make the adapter in `path` servable under `name` (also a hot swap)."""

    @abstractmethod
    async def _unload_adapter(self, name: str, lora_id: int) -> None:
        """Drop the adapter."""

    def supported_updates(self) -> set[str]:
        """The LoRA updates (`load_lora`, `unload_lora`, `list_loras`)."""
        return set(LORA_UPDATES)

    async def engine_update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        """Hand LoRA updates to the adapter host."""
        if update in LORA_UPDATES:
            return await self.lora_host.handle(update, body)
        return await super().engine_update(update, body)


@dataclass(eq=False)
class AdapterVersion:
    """One version of an adapter inside an engine, and how many requests still use it.
    Engines subclass it with what their weights need (PEFT's name, vLLM's id)."""

    name: str
    users: int = field(default=0, kw_only=True)
    retired: bool = field(default=False, kw_only=True)


Version = TypeVar("Version", bound=AdapterVersion)


class AdapterVersions(Generic[Version]):
    """The version each adapter name serves now, and the retirement of the others.

    A request keeps the version it started with (`acquire` / `release`): loading a new
    version under a name (`install`) or unloading the name (`unload`) retires the old one,
    which leaves the engine (`free`) at once when no request uses it, else when the last
    of them ends.
    """

    def __init__(self, free: Callable[[Version], Awaitable[None]]) -> None:
        self._free = free
        self._current: dict[str, Version] = {}
        # Frees started from synchronous code, referenced until done.
        self._background: set[asyncio.Future[None]] = set()

    def names(self) -> list[str]:
        """The names requests may select now."""
        return sorted(self._current)

    def get(self, name: str) -> Version | None:
        """The version `name` serves now."""
        return self._current.get(name)

    def for_model(
        self, model: str | None, base_names: Collection[str], served: str
    ) -> Version | None:
        """The version a request's `model` selects (None: the base model, one of
        `base_names`); a 404 `RequestError` for any other name."""
        if not model or model in base_names:
            return None
        version = self._current.get(model)
        if version is None:
            raise RequestError(
                f"model {model!r} is neither the served model {served!r} nor a loaded LoRA "
                f"adapter (loaded: {self.names()})",
                status=404,
                param="model",
            )
        return version

    async def install(self, version: Version) -> None:
        """Serve `version` under its name; the version it replaces is retired."""
        previous = self._current.get(version.name)
        self._current[version.name] = version
        if previous is not None:
            await self._retire(previous)

    async def unload(self, name: str) -> None:
        """Stop serving `name`; requests running on it keep their version."""
        version = self._current.pop(name, None)
        if version is not None:
            await self._retire(version)

    async def _retire(self, version: Version) -> None:
        version.retired = True
        if version.users == 0:
            await self._free(version)

    @staticmethod
    def acquire(version: Version | None) -> None:
        """A request starts on `version` (None: the base model)."""
        if version is not None:
            version.users += 1

    def release(self, version: Version | None) -> None:
        """A request on `version` ended; the last one on a retired version frees it."""
        if version is None:
            return
        version.users -= 1
        if version.retired and version.users == 0:
            task = asyncio.ensure_future(self._free(version))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
