"""The Kubernetes discovery backend: the pod's `DynamoWorkerMetadata`, as upstream writes it.

Upstream Dynamo's frontends in a namespace watch `DynamoWorkerMetadata` objects
(`nvidia.com/v1alpha1`, plural `dynamoworkermetadatas`) and the EndpointSlices of the workers'
Service: an instance is routable while its pod is Ready in such a slice and its object's
`spec.data` (a `DiscoveryMetadata` JSON) lists it. Each worker server-side-applies its own
object, named after its pod (field manager `dynamo-worker`, forced), owned by the pod
(`controller: true`, `blockOwnerDeletion: false`) so the garbage collector deletes it with the
pod. The instance id is derived from that name (see `records.kubernetes_instance_id`).
The frontend runs in another pod, so the model cards name their files by `http://` URL on
this worker's system server rather than by local path (the worker decides; `card_files.py`).

Unregistering applies `spec.data` with an empty `endpoints` map and keeps the model cards:
upstream's readers drop the instance at once while the pod drains (its readiness may lag),
and the object itself goes with the pod. Upstream's own worker does the same on shutdown
(it removes its endpoint entries and leaves the object to the garbage collector).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo.runtime.discovery.base import WorkerAdvertisement
from dynamo.runtime.discovery.records import ENDPOINTS, build_metadata, kubernetes_instance_id
from dynamo.runtime.kube_api import api_client

log = logging.getLogger(__name__)

GROUP, VERSION = "nvidia.com", "v1alpha1"
PLURAL, KIND = "dynamoworkermetadatas", "DynamoWorkerMetadata"
FIELD_MANAGER = "dynamo-worker"
_RETRIES = 5  # transient API errors (overload, restarts) before giving up
# Server-side apply; passed as a keyword mapping because the client's stubs omit it.
_APPLY: dict[str, Any] = {"_content_type": "application/apply-patch+yaml"}


@dataclass(frozen=True)
class PodIdentity:
    """The pod this worker runs in (downward-API env) and the object name it publishes."""

    name: str
    namespace: str
    uid: str
    cr_name: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PodIdentity:
        """Read POD_NAME, POD_NAMESPACE, POD_UID; in container mode
        (`DYN_KUBE_DISCOVERY_MODE=container`) the object is `<pod>-<CONTAINER_NAME>` unless
        the container is `main`, as upstream names it."""
        missing = [k for k in ("POD_NAME", "POD_NAMESPACE", "POD_UID") if not environ.get(k)]
        if missing:
            raise ValueError(
                f"DYN_DISCOVERY_BACKEND=kubernetes needs {', '.join(missing)} set from the"
                " downward API (metadata.name, metadata.namespace, metadata.uid)"
            )
        name = environ["POD_NAME"]
        cr_name = name
        if environ.get("DYN_KUBE_DISCOVERY_MODE", "pod").strip().lower() == "container":
            container = environ.get("CONTAINER_NAME", "")
            if not container:
                raise ValueError("DYN_KUBE_DISCOVERY_MODE=container needs CONTAINER_NAME set")
            if container != "main":
                cr_name = f"{name}-{container}"
        return cls(name, environ["POD_NAMESPACE"], environ["POD_UID"], cr_name)

    @property
    def instance_id(self) -> int:
        """The instance id upstream readers expect for this object name."""
        return kubernetes_instance_id(self.cr_name)


class KubernetesBackend:
    """Server-side-applies this pod's DynamoWorkerMetadata."""

    def __init__(
        self,
        pod: PodIdentity,
        *,
        api: client.ApiClient | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self.pod = pod
        self._api = api
        self._owns_api = api is None
        self._environ = dict(environ)
        self._metadata: dict[str, Any] | None = None
        self._withdrawn = False
        self._lock = asyncio.Lock()  # applies land in call order

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KubernetesBackend:
        """A backend for the pod the downward-API env names; the API client is made lazily."""
        return cls(PodIdentity.from_env(environ), environ=environ)

    async def register(self, advertisement: WorkerAdvertisement) -> None:
        """Apply the object with the endpoint and every model card."""
        self._check_instance_id(advertisement)
        self._withdrawn = False
        await self._apply(await build_metadata(advertisement))

    async def update(self, advertisement: WorkerAdvertisement) -> None:
        """Apply the new cards (after unregister the endpoint stays withdrawn)."""
        self._check_instance_id(advertisement)
        await self._apply(await build_metadata(advertisement))

    async def unregister(self) -> None:
        """Apply `spec.data.endpoints = {}`: upstream readers drop this instance now."""
        self._withdrawn = True
        if self._metadata is not None:
            await self._apply(self._metadata)

    async def close(self) -> None:
        """Close the API client. The object stays until the pod is deleted (its owner)."""
        if self._api is not None and self._owns_api:
            await self._api.close()
            self._api = None

    def metadata(self) -> dict[str, Any] | None:
        """A copy of the last applied `spec.data`, or None before register."""
        return copy.deepcopy(self._metadata)

    def manifest(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The object to apply for `data` (a DiscoveryMetadata JSON)."""
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {
                "name": self.pod.cr_name,
                "namespace": self.pod.namespace,
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": self.pod.name,
                        "uid": self.pod.uid,
                        "controller": self.pod.cr_name == self.pod.name,
                        "blockOwnerDeletion": False,
                    }
                ],
            },
            "spec": {"data": copy.deepcopy(dict(data))},
        }

    def _check_instance_id(self, advertisement: WorkerAdvertisement) -> None:
        expected = self.pod.instance_id
        if advertisement.instance_id != expected:
            raise ValueError(
                f"instance_id {advertisement.instance_id} does not match the id upstream readers"
                f" derive from the object name {self.pod.cr_name!r} ({expected}); take it from"
                " dynamo.runtime.discovery.instance_id_from_env()"
            )

    async def _apply(self, metadata: dict[str, Any]) -> None:
        metadata = copy.deepcopy(metadata)
        if self._withdrawn:
            metadata[ENDPOINTS] = {}
        async with self._lock:
            objects = client.CustomObjectsApi(await self._client())
            for attempt in range(_RETRIES):
                try:
                    await objects.patch_namespaced_custom_object(
                        GROUP,
                        VERSION,
                        self.pod.namespace,
                        PLURAL,
                        self.pod.cr_name,
                        self.manifest(metadata),
                        field_manager=FIELD_MANAGER,
                        force=True,
                        **_APPLY,
                    )
                    break
                except ApiException as exc:
                    if exc.status in (429, 500, 502, 503, 504) and attempt + 1 < _RETRIES:
                        log.warning("apply of %s: HTTP %s; retrying", self.pod.cr_name, exc.status)
                        await asyncio.sleep(0.2 * 2**attempt)
                        continue
                    raise self._explain(exc) from exc
            self._metadata = metadata

    def _explain(self, exc: ApiException) -> Exception:
        where = f"{PLURAL}.{GROUP} {self.pod.cr_name!r} in namespace {self.pod.namespace!r}"
        if exc.status == 404:
            return RuntimeError(
                f"cannot apply {where}: the namespace does not exist or the"
                " DynamoWorkerMetadata CRD is not installed"
                " (crds/nvidia.com_dynamoworkermetadatas.yaml)"
            )
        if exc.status == 403:
            return RuntimeError(
                f"cannot apply {where}: the pod's service account needs get/create/patch on"
                f" {PLURAL}.{GROUP}"
            )
        return RuntimeError(f"cannot apply {where}: HTTP {exc.status} {exc.reason}: {exc.body!r}")

    async def _client(self) -> client.ApiClient:
        if self._api is None:
            self._api = await api_client(self._environ)
        return self._api
