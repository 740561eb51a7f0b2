"""The runtime's side of LoRA: engine updates with metrics, and the adapter list it publishes.

Every engine update passes through `EngineUpdates.call`. For `load_lora` it times the call
(`lora_load_duration_seconds`), counts failures by reason and downloaded bytes; after a
successful `load_lora` or `unload_lora` it re-reads the engine's adapter list
(`list_loras`), updates `/v1/models` and the adapters gauge, and re-publishes discovery
(one model card per adapter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dynamo.common.backend.engine import BaseEngine
from dynamo.runtime.metrics import RuntimeMetrics
from dynamo.runtime.models import ServedModels

logger = logging.getLogger(__name__)

LORA_CHANGES = frozenset({"load_lora", "unload_lora"})


class EngineUpdates:
    """Forwards engine updates and keeps the adapter list current."""

    def __init__(
        self,
        engine: BaseEngine,
        *,
        metrics: RuntimeMetrics,
        models: ServedModels,
        republish: Callable[[], Awaitable[None]],
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._models = models
        self._republish = republish
        # Adapter name -> the URI it was loaded from (for its discovery card).
        self.sources: dict[str, str] = {}

    def adapters(self) -> dict[str, tuple[int, str]]:
        """Loaded adapters: name -> (lora id, source uri)."""
        return {
            name: (lora_id, self.sources.get(name, ""))
            for name, lora_id in self._models.adapters.items()
        }

    async def call(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run one engine update (the `/engine/update/<name>` and `/v1/loras` path)."""
        if name != "load_lora":
            result = await self._engine.engine_update(name, body)
        else:
            result = await self._timed_load(body)
        if name in LORA_CHANGES and _succeeded(result):
            lora_name = body.get("lora_name")
            if isinstance(lora_name, str):
                if name == "load_lora":
                    source = body.get("source")
                    uri = source.get("uri") if isinstance(source, dict) else None
                    self.sources[lora_name] = uri if isinstance(uri, str) else ""
                else:
                    self.sources.pop(lora_name, None)
            await self.refresh()
        return result

    async def _timed_load(self, body: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            result = await self._engine.engine_update("load_lora", body)
        except Exception:
            self._metrics.count_lora_failure("engine exception")
            raise
        finally:
            self._metrics.lora_load_duration.observe(time.perf_counter() - started)
        if _succeeded(result):
            downloaded = result.get("downloaded_bytes")
            if isinstance(downloaded, int) and downloaded > 0:
                self._metrics.lora_downloaded_bytes.inc(downloaded)
        else:
            reason = result.get("reason") if isinstance(result, dict) else None
            self._metrics.count_lora_failure(str(reason or "unknown"))
        return result

    async def refresh(self) -> None:
        """Re-read the engine's adapters; update `/v1/models`, the gauge and discovery."""
        if "list_loras" not in self._engine.supported_updates():
            return
        try:
            listing = await self._engine.engine_update("list_loras", {})
        except Exception:
            logger.exception("list_loras failed; the adapter list may be stale")
            return
        loras = listing.get("loras") if isinstance(listing, dict) else None
        if not isinstance(loras, dict):
            logger.warning("list_loras answered %r without a 'loras' object", listing)
            return
        self._models.adapters = {str(name): int(lora_id) for name, lora_id in loras.items()}
        for gone in set(self.sources) - set(self._models.adapters):
            del self.sources[gone]
        self._metrics.lora_loaded.set(len(self._models.adapters))
        try:
            await self._republish()
        except Exception:
            logger.exception("publishing the adapter change to discovery failed")


def _succeeded(result: Any) -> bool:
    return isinstance(result, dict) and str(result.get("status", "")).lower() != "error"
