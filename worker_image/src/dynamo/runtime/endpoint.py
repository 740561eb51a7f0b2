"""`Endpoint`: the serving endpoint handed to `engine.on_endpoint_ready` (upstream's shape).

Engines that publish their own discovery facts keep it: `connection_id()` is the instance
id, `metrics` the engine-metrics handle, and `unregister_endpoint_instance()` /
`register_endpoint_instance()` withdraw and re-publish this worker in discovery, and
`publish_model_taints(taints)` is how `dynamo.common.model_taints.update_model_taints`
reaches this worker's discovery record.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from dynamo.runtime.metrics import EngineMetrics


class Endpoint:
    """One served endpoint: `namespace.component.name`."""

    def __init__(
        self,
        *,
        namespace: str,
        component: str,
        name: str,
        instance_id: int,
        metrics: EngineMetrics,
        register: Callable[[], Awaitable[None]],
        unregister: Callable[[], Awaitable[None]],
        publish_taints: Callable[[set[str]], Awaitable[None]],
    ) -> None:
        self.namespace = namespace
        self.component = component
        self.name = name
        self.metrics = metrics
        self._instance_id = instance_id
        self._register = register
        self._unregister = unregister
        self._publish_taints = publish_taints

    def connection_id(self) -> int:
        """The discovery instance id (upstream's connection id)."""
        return self._instance_id

    def path(self) -> str:
        """`namespace.component.name`."""
        return f"{self.namespace}.{self.component}.{self.name}"

    async def unregister_endpoint_instance(self) -> None:
        """Withdraw this worker from discovery (no new requests get routed here)."""
        await self._unregister()

    async def register_endpoint_instance(self) -> None:
        """Publish this worker in discovery again."""
        await self._register()

    async def publish_model_taints(self, taints: set[str]) -> None:
        """Replace the caller-managed model taints in this worker's discovery record."""
        await self._publish_taints(taints)
