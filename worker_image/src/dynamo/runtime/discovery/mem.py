"""The in-memory discovery backend: the records live in this process only.

Used when the worker runs outside Kubernetes and no shared folder is wanted (standalone runs,
tests). `/metadata` still shows exactly what the other backends would publish.
"""

from __future__ import annotations

import copy
from typing import Any

from dynamo.runtime.discovery.base import WorkerAdvertisement
from dynamo.runtime.discovery.records import ENDPOINTS, build_metadata


class MemBackend:
    """Keeps the current DiscoveryMetadata in memory; `history` lists every change made."""

    def __init__(self) -> None:
        self._metadata: dict[str, Any] | None = None
        self._withdrawn = False
        self.history: list[tuple[str, dict[str, Any] | None]] = []

    async def register(self, advertisement: WorkerAdvertisement) -> None:
        """Publish the endpoint and cards (a later register re-publishes the endpoint)."""
        self._withdrawn = False
        self._publish("register", await build_metadata(advertisement))

    async def update(self, advertisement: WorkerAdvertisement) -> None:
        """Replace the cards; after `unregister` the endpoint stays withdrawn."""
        self._publish("update", await build_metadata(advertisement))

    async def unregister(self) -> None:
        """Withdraw the endpoint; the model cards stay until `close`."""
        self._withdrawn = True
        if self._metadata is not None:
            self._publish("unregister", self._metadata)

    async def close(self) -> None:
        """Forget everything."""
        self._metadata = None
        self.history.append(("close", None))

    def metadata(self) -> dict[str, Any] | None:
        """A copy of the current DiscoveryMetadata, or None before register / after close."""
        return copy.deepcopy(self._metadata)

    def _publish(self, what: str, metadata: dict[str, Any]) -> None:
        metadata = copy.deepcopy(metadata)
        if self._withdrawn:
            metadata[ENDPOINTS] = {}
        self._metadata = metadata
        self.history.append((what, copy.deepcopy(metadata)))
