"""Presence in a cluster: the activator's DynamoWorkerMetadata and its EndpointSlice entry.

* The metadata object is named after the activator's pod and owned by it (so it goes with
  the pod), server-side-applied with field manager `dynamo-activator`, forced, exactly as a
  worker publishes its own (`dynamo.runtime.discovery.kubernetes`).
* The `<worker>-activator` EndpointSlice is created, empty, by the operator. The activator
  server-side-applies only its `endpoints` (field manager `dynamo-activator`, forced): its
  `POD_IP` with `targetRef` its pod, `ready: true` to step in, `ready: false` to step out
  (from its start on, so the operator's autoscaler always finds its address there). It never
  creates the slice: without it, applying fails (and is retried).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo.activator.config import ActivatorConfig
from dynamo.runtime.discovery.kubernetes import (
    GROUP,
    PLURAL,
    VERSION,
    KubernetesBackend,
    PodIdentity,
)
from dynamo.runtime.kube_api import api_client

log = logging.getLogger(__name__)

FIELD_MANAGER = "dynamo-activator"
_APPLY: dict[str, Any] = {"_content_type": "application/apply-patch+yaml"}
_RETRIES = 5


def slice_apply(config: ActivatorConfig, ready: bool) -> dict[str, Any]:
    """The apply configuration of the activator's slice: its one endpoint, ready or not. A
    not-ready endpoint routes nothing (kube-proxy and upstream's discovery take ready ones
    only) and tells the operator's autoscaler where to read the activator's held requests."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": config.activator_slice, "namespace": config.namespace},
        "endpoints": [
            {
                "addresses": [config.pod_ip],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "targetRef": {
                    "kind": "Pod",
                    "name": config.pod_name,
                    "namespace": config.namespace,
                    "uid": config.pod_uid,
                },
            }
        ],
    }


class KubePresence:
    """Applies the activator's metadata object and slice entry."""

    def __init__(self, config: ActivatorConfig, environ: Mapping[str, str]) -> None:
        self.config = config
        self._environ = environ
        self._api: client.ApiClient | None = None
        pod = PodIdentity(config.pod_name, config.namespace, config.pod_uid, config.pod_name)
        self._manifests = KubernetesBackend(pod, environ=environ)  # builds the object only
        self._metadata: dict[str, Any] | None = None

    async def step_in(self, metadata: dict[str, Any]) -> None:
        # Cards first, then the endpoint that makes them routable.
        await self._apply_metadata(metadata)
        self._metadata = metadata
        await self._apply_slice(ready=True)

    async def step_out(self) -> None:
        # Routing first: the slice entry, then the metadata's endpoints.
        await self._apply_slice(ready=False)
        if self._metadata is not None:
            await self._apply_metadata({**self._metadata, "endpoints": {}})

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _apply_metadata(self, data: dict[str, Any]) -> None:
        objects = client.CustomObjectsApi(await self._client())
        await self._retrying(
            "DynamoWorkerMetadata",
            lambda: objects.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                self.config.namespace,
                PLURAL,
                self.config.pod_name,
                self._manifests.manifest(data),
                field_manager=FIELD_MANAGER,
                force=True,
                **_APPLY,
            ),
        )

    async def _apply_slice(self, ready: bool) -> None:
        slices = client.DiscoveryV1Api(await self._client())
        await self._retrying(
            f"EndpointSlice {self.config.activator_slice}",
            lambda: slices.patch_namespaced_endpoint_slice(
                self.config.activator_slice,
                self.config.namespace,
                slice_apply(self.config, ready),
                field_manager=FIELD_MANAGER,
                force=True,
                **_APPLY,
            ),
        )

    async def _retrying(self, what: str, call: Any) -> None:
        for attempt in range(_RETRIES):
            try:
                await call()
                return
            except ApiException as exc:
                if exc.status in (429, 500, 502, 503, 504) and attempt + 1 < _RETRIES:
                    await asyncio.sleep(0.2 * 2**attempt)
                    continue
                raise RuntimeError(
                    f"cannot apply {what} in namespace {self.config.namespace}: HTTP"
                    f" {exc.status} {exc.reason} (the activator's Role needs get/patch on it)"
                ) from exc

    async def _client(self) -> client.ApiClient:
        if self._api is None:
            self._api = await api_client(self._environ)
        return self._api
