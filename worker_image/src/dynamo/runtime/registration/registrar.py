"""`Registration`: this worker's entry in its discovery backend.

The lifecycle registers once the worker serves; adapter loads and taint updates republish
the entry; the discovery-changing admin controls unregister and re-register it; shutdown
leaves discovery once. `lock` serializes all of these, so a signal during startup can never
leave the worker registered, and discovery-changing controls never overlap shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dynamo.runtime.discovery.base import DiscoveryBackend, WorkerAdvertisement

logger = logging.getLogger(__name__)


class Registration:
    """Publishes what `advertisement()` returns; `stopping` is set once shutdown began."""

    def __init__(
        self,
        discovery: DiscoveryBackend,
        advertisement: Callable[[], WorkerAdvertisement],
        stopping: asyncio.Event,
    ) -> None:
        self.discovery = discovery
        self._advertisement = advertisement
        self._stopping = stopping
        self.lock = asyncio.Lock()
        self.registered = False
        # Caller-managed model taints (`/engine/update/model_taints`), sorted.
        self.taints: list[str] = []

    async def register(self) -> None:
        """Publish the current advertisement."""
        await self.discovery.register(self._advertisement())

    async def unregister(self) -> None:
        """Withdraw the entry (the admin controls that take the worker out of service)."""
        await self.discovery.unregister()

    async def republish(self) -> None:
        """Update the entry after a change; nothing before the first registration or once
        shutdown began."""
        if self.registered and not self._stopping.is_set():
            await self.discovery.update(self._advertisement())

    async def update_taints(self, taints: set[str]) -> None:
        """New caller-managed model taints: keep them and republish."""
        self.taints = sorted(taints)
        await self.republish()

    async def leave(self) -> None:
        """Unregister once, waiting for a discovery-changing control in progress (errors
        are logged)."""
        try:
            async with self.lock:
                if self.registered:
                    await self.discovery.unregister()
                    self.registered = False
                    logger.info("unregistered from discovery")
        except Exception:
            logger.exception("unregistering from discovery failed")
