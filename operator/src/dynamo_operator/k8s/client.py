"""A thin client over kubernetes_asyncio: server-side apply, reads, status patches, events and
CRD checks, each request counted.

Requests go through `ApiClient.call_api` with explicit paths (see `k8s.kinds`) rather than the
generated per-kind APIs: one code path for every kind, plain dicts in and out, and one place
to count requests. Every write is counted per kind and verb (`OperatorMetrics.api_requests`),
which is how tests assert that a converged cluster sees no writes.

With leader election, `fence` is called before every write and refuses it once this replica
may no longer write (`k8s.election`). (Fault-injection tests kill the operator after its k-th
write at the API server's door: `tests/support/api_proxy.py`.)
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.k8s.election import NotLeader
from dynamo_operator.k8s.kinds import CRD, EVENT, POD, Kind, kind_of
from dynamo_operator.metrics import WRITE_VERBS, OperatorMetrics

logger = logging.getLogger(__name__)

FIELD_MANAGER = "dynamo-operator"
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON = "application/json"
# Connections the client keeps to the API server (the library's default is 100). Reconciles
# run at most 16 at a time, so more would only hold TLS buffers after a burst of status
# writes; a request beyond the bound waits for a free connection.
API_CONNECTIONS = 32


class ApiError(Exception):
    """The API server refused a request (`status` 0: no answer at all)."""

    def __init__(self, status: int, reason: str, message: str, what: str) -> None:
        super().__init__(f"{what}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.what = what

    @property
    def retryable(self) -> bool:
        """Whether trying again later may succeed without anyone changing anything."""
        return self.status in (0, 409, 429) or self.status >= 500


def _api_error(exc: ApiException, what: str) -> ApiError:
    message, reason = str(exc.reason or ""), str(exc.reason or "")
    try:
        body = json.loads(exc.body or "{}")
        message = str(body.get("message") or message)
        reason = str(body.get("reason") or reason)
    except (ValueError, AttributeError):
        pass
    return ApiError(int(exc.status or 0), reason, message, what)


async def connect(kubeconfig: str | None = None) -> client.ApiClient:
    """An ApiClient for the in-cluster service account, else the kubeconfig (the KUBECONFIG
    environment variable or ~/.kube/config when `kubeconfig` is None)."""
    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        # Read KUBECONFIG now: the client library reads it once, at import.
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        await config.load_kube_config(config_file=path, client_configuration=cfg)
    cfg.connection_pool_maxsize = API_CONNECTIONS
    return client.ApiClient(cfg)


async def _text_of(response: Any, what: str) -> str:
    """The body of a raw (not preloaded) response, or its refusal as an ApiError."""
    try:
        body: str = await response.text()
    except (OSError, TimeoutError) as exc:
        raise ApiError(0, type(exc).__name__, str(exc) or "no answer", what) from None
    finally:
        response.release()
    if not 200 <= response.status <= 299:
        raise ApiError(response.status, str(response.reason or ""), body[:500], what)
    return body


class Cluster:
    """The operator's requests to the API server."""

    def __init__(
        self,
        api: client.ApiClient,
        metrics: OperatorMetrics | None = None,
        *,
        request_timeout_seconds: float = 30.0,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self._api = api
        self._fence = fence
        self._metrics = metrics
        self._timeout = request_timeout_seconds
        self.requests: Counter[tuple[str, str]] = Counter()

    @property
    def writes(self) -> int:
        """Write requests made so far (all kinds)."""
        return sum(n for (verb, _), n in self.requests.items() if verb in WRITE_VERBS)

    def _count(self, verb: str, kind: Kind) -> None:
        self.requests[(verb, kind.kind)] += 1
        if self._metrics is not None:
            self._metrics.api_requests.labels(verb=verb, kind=kind.kind).inc()

    async def _call(
        self,
        method: str,
        path: str,
        what: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = JSON,
        text: bool = False,
    ) -> Any:
        if method != "GET" and self._fence is not None:
            # Leader election's fencing rule (k8s.election): no write after the deadline.
            try:
                self._fence()
            except NotLeader as exc:
                raise ApiError(0, "NotLeader", str(exc), what) from None
        try:
            result = await self._api.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Accept": "*/*" if text else JSON, "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                response_types_map={200: "object", 201: "object", 202: "object"},
                # The client would parse a text body that happens to be JSON; take it raw.
                _preload_content=not text,
                _return_http_data_only=True,
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            raise _api_error(exc, what) from None
        except (OSError, TimeoutError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc) or "no answer", what) from None
        if text:
            return await _text_of(result, what)
        return dict(result or {})

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        self._count("get", kind)
        try:
            return await self._call("GET", kind.path(namespace, name), f"get {kind.kind} {name}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list(
        self, kind: Kind, namespace: str | None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """The objects of a kind (in one namespace), optionally selected by labels."""
        self._count("list", kind)
        query = [("labelSelector", label_selector)] if label_selector else []
        result = await self._call(
            "GET", kind.collection_path(namespace), f"list {kind.plural}", query=query
        )
        return list(result.get("items") or [])

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply `manifest` as the operator's field manager, taking over conflicting
        fields (`force`): the operator is the one writer of the fields it sets."""
        kind = kind_of(dict(manifest))
        meta = manifest["metadata"]
        name, namespace = meta["name"], meta.get("namespace")
        self._count("apply", kind)
        result = await self._call(
            "PATCH",
            kind.path(namespace, name),
            f"apply {kind.kind} {name}",
            body=dict(manifest),
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type=APPLY_PATCH,
        )
        return result

    async def delete(self, kind: Kind, namespace: str | None, name: str, uid: str) -> bool:
        """Delete the object if it is still the one with `uid` (a precondition, so a newer
        object of the same name is never deleted by mistake). False when already gone."""
        self._count("delete", kind)
        body = {"preconditions": {"uid": uid}, "propagationPolicy": "Background"}
        try:
            await self._call(
                "DELETE", kind.path(namespace, name), f"delete {kind.kind} {name}", body=body
            )
        except ApiError as err:
            if err.status in (404, 409):
                return False
            raise
        return True

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON-merge-patch the status subresource with `{"status": patch}`."""
        self._count("patch-status", kind)
        result = await self._call(
            "PATCH",
            kind.path(namespace, name) + "/status",
            f"patch {kind.kind} {name} status",
            body={"status": dict(patch)},
            content_type=MERGE_PATCH,
        )
        return result

    async def patch(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON-merge-patch the object (the autoscaler's spec.replicas, a pod's annotation):
        only the fields in `patch` change, with no claim on any other field."""
        self._count("patch", kind)
        result = await self._call(
            "PATCH",
            kind.path(namespace, name),
            f"patch {kind.kind} {name}",
            body=dict(patch),
            content_type=MERGE_PATCH,
        )
        return result

    async def patch_pod_conditions(
        self, namespace: str, name: str, conditions: Sequence[Mapping[str, Any]]
    ) -> None:
        """Set pod status conditions by type (a strategic merge patch: the kubelet's own
        conditions stay, unlike with a merge patch, which would replace the list)."""
        self._count("patch-status", POD)
        await self._call(
            "PATCH",
            POD.path(namespace, name) + "/status",
            f"patch Pod {name} status",
            body={"status": {"conditions": [dict(c) for c in conditions]}},
            content_type=STRATEGIC_MERGE_PATCH,
        )

    async def pod_log_tail(self, namespace: str, name: str, container: str, lines: int) -> str:
        """The last `lines` lines of a container's log (pods/log)."""
        self._count("get-log", POD)
        result: str = await self._call(
            "GET",
            POD.path(namespace, name) + "/log",
            f"get Pod {name} log",
            query=[("container", container), ("tailLines", str(lines))],
            text=True,
        )
        return result

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        """Record an events.k8s.io/v1 Event."""
        self._count("create", EVENT)
        await self._call("POST", EVENT.collection_path(namespace), "create Event", body=dict(event))

    async def crd_exists(self, name: str) -> bool:
        """Whether the CustomResourceDefinition `name` is installed."""
        return await self.get(CRD, None, name) is not None

    async def create_crd_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create a CRD unless one of that name exists (whoever installed it); True if created."""
        name = manifest["metadata"]["name"]
        if await self.crd_exists(name):
            return False
        self._count("create", CRD)
        try:
            await self._call("POST", CRD.collection_path(), f"create CRD {name}", body=manifest)
        except ApiError as err:
            if err.status == 409:
                return False
            raise
        return True
