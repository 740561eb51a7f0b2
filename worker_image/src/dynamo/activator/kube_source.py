"""The pod source in a cluster: watches of the worker's EndpointSlices and the namespace's
DynamoWorkerMetadata objects (kubernetes_asyncio).

Each kind is listed, then watched from the list's resourceVersion; a watch that ends (its
timeout, about every 5 minutes: a resync) or fails (410 Gone, a dropped connection, an API
error) leads to a fresh list after a short back-off, so the view converges whatever was
missed. After every change the joined view (`pods.worker_view`) goes to the sink: the ready
pods, from every slice but the activator's own (`<worker>-activator`) and without its own
metadata object, and the operator's mark on that own slice.
Needs list/watch on `endpointslices` (discovery.k8s.io) and `dynamoworkermetadatas`
(nvidia.com) in the namespace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kubernetes_asyncio import client, watch

from dynamo.activator.config import ActivatorConfig
from dynamo.activator.pods import SERVICE_NAME_LABEL, ViewSink, worker_view
from dynamo.runtime.discovery.kubernetes import GROUP, PLURAL, VERSION
from dynamo.runtime.kube_api import api_client

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)

Lister = Callable[..., Awaitable[Any]]


class KubePodSource:
    """Follows the worker's ready pods through the Kubernetes API."""

    def __init__(self, config: ActivatorConfig, environ: Mapping[str, str]) -> None:
        self.config = config
        self._environ = environ
        self._slices: dict[str, dict[str, Any]] = {}
        self._metadata: dict[str, dict[str, Any]] = {}

    async def run(self, sink: ViewSink) -> None:
        api = await api_client(self._environ)
        try:
            slices = client.DiscoveryV1Api(api)
            objects = client.CustomObjectsApi(api)
            selector = f"{SERVICE_NAME_LABEL}={self.config.worker}"

            def publish() -> None:
                own, port = self.config.activator_slice, self.config.http_port
                sink(worker_view(self._slices, self._metadata, own, port))

            async def list_slices(**kwargs: Any) -> Any:
                return await slices.list_namespaced_endpoint_slice(
                    self.config.namespace, label_selector=selector, **kwargs
                )

            async def list_metadata(**kwargs: Any) -> Any:
                return await objects.list_namespaced_custom_object(
                    GROUP, VERSION, self.config.namespace, PLURAL, **kwargs
                )

            await asyncio.gather(
                self._follow(api, list_slices, self._slices, dict, publish),
                self._follow(api, list_metadata, self._metadata, self._keep_metadata, publish),
            )
        finally:
            await api.close()

    def _keep_metadata(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        if obj["metadata"]["name"] == self.config.pod_name:
            return None
        data = (obj.get("spec") or {}).get("data")
        return dict(data) if isinstance(data, Mapping) else None

    async def _follow(
        self,
        api: client.ApiClient,
        lister: Lister,
        state: dict[str, dict[str, Any]],
        keep: Callable[[Mapping[str, Any]], dict[str, Any] | None],
        publish: Callable[[], None],
    ) -> None:
        """List, then watch, forever; `state` maps object names to what `keep` made of them."""
        failures = 0
        while True:
            try:
                listed = await lister()
                listed = (
                    listed if isinstance(listed, dict) else api.sanitize_for_serialization(listed)
                )
                state.clear()
                for obj in listed.get("items") or []:
                    kept = keep(obj)
                    if kept is not None:
                        state[obj["metadata"]["name"]] = kept
                publish()
                version = (listed.get("metadata") or {}).get("resourceVersion")
                async with watch.Watch() as stream:
                    async for event in stream.stream(
                        lister, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S
                    ):
                        failures = 0
                        self._apply(event, state, keep)
                        publish()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                log.warning("watch failed (%r); listing again in %s s", exc, delay)
                await asyncio.sleep(delay)

    @staticmethod
    def _apply(
        event: Mapping[str, Any],
        state: dict[str, dict[str, Any]],
        keep: Callable[[Mapping[str, Any]], dict[str, Any] | None],
    ) -> None:
        kind = event.get("type")
        obj = event.get("raw_object") or event.get("object")
        if not isinstance(obj, Mapping):
            return
        if kind == "ERROR":
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        name = obj["metadata"]["name"]
        kept = keep(obj) if kind in ("ADDED", "MODIFIED") else None
        if kept is None:
            state.pop(name, None)
        else:
            state[name] = kept
