"""Every kopf index the handlers keep, and one typed view of them.

kopf fills in-memory indices from its watches and hands each handler every index as a
keyword argument named after the index's id; `Indices.of(kwargs)` reads them. The records are
the reconcile layer's (a pod's summary, a DynamoWorker as its adapters see it, a LoRAAdapter
as its workers see it, and each child of a DynamoWorker, `reconcile.children`), so a
reconcile reads nothing from the API server.

The watches of pods and of the children's kinds are restricted on the API server by label
(`restrict_watches`): the operator is sent only worker pods (both roles' of a disaggregated
worker) and what it manages itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import kopf
from pydantic import ValidationError

from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.k8s import kinds
from dynamo_operator.reconcile.children import CachedChild, ChildKey
from dynamo_operator.reconcile.dynamoworker.labels import (
    COMPONENT_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    WORKER_COMPONENT,
    worker_of,
)
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary, metadata_by_pod
from dynamo_operator.reconcile.loraadapter.model import Pod
from dynamo_operator.reconcile.loraadapter.reconciler import NamespaceView
from dynamo_operator.reconcile.loraadapter.targeting import AdapterRef, WorkerInfo

DW = ("dynamo.dev", "v1alpha1", "dynamoworkers")
LORA = ("dynamo.dev", "v1alpha1", "loraadapters")
DWM = ("nvidia.com", "v1alpha1", "dynamoworkermetadatas")
MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
# The worker pods of both roles (a prefill pod has no worker label, so that label cannot
# select them all): the worker component of the operator's pods.
WORKER_POD_SELECTOR = f"{COMPONENT_LABEL}={WORKER_COMPONENT},{MANAGED_BY_LABEL}={MANAGED_BY}"
# Every kind the DynamoWorker reconciler writes, each watched and indexed by name.
CHILD_KINDS = (
    kinds.SERVICE_ACCOUNT,
    kinds.ROLE,
    kinds.ROLE_BINDING,
    kinds.SERVICE,
    kinds.POD_DISRUPTION_BUDGET,
    kinds.DEPLOYMENT,
    kinds.NETWORK_POLICY,
    kinds.POD_MONITOR,
    kinds.PERSISTENT_VOLUME_CLAIM,
    kinds.JOB,
    kinds.ENDPOINT_SLICE,
)

log = logging.getLogger(__name__)


def namespace_of(namespace: str | None) -> str:
    """The namespace of an object of the operator's kinds (all of them namespaced; kopf types
    the argument for cluster-scoped kinds too)."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced object arrived without a namespace")
    return namespace


def _first(values: Iterable[Any] | None) -> Any:
    return next(iter(values), None) if values is not None else None


def is_worker_pod(labels: kopf.Labels, **_: Any) -> bool:
    """kopf's filter of the pod handlers: a DynamoWorker's pod, of either role."""
    return worker_of(labels) is not None


def resource_of(kind: kinds.Kind) -> tuple[str, str, str]:
    """kopf's (group, version, plural) of `kind`."""
    group, _, version = kind.api_version.rpartition("/")
    return group, version, kind.plural


# Every resource a handler or index is registered for: kopf keeps one watch of each, in each
# namespace (the unit tests hold this to the registry).
WATCHED_RESOURCES = (DW, LORA, resource_of(kinds.POD), DWM, *map(resource_of, CHILD_KINDS))


def child_index_id(kind: kinds.Kind) -> str:
    return f"children_{kind.plural}"


def restrict_watches(settings: kopf.OperatorSettings) -> None:
    """Ask the API server for worker pods and the operator's own children only (every handler
    of those kinds filters by the same labels)."""
    settings.watching.label_selectors[resource_of(kinds.POD)] = WORKER_POD_SELECTOR
    selector = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
    for kind in CHILD_KINDS:
        settings.watching.label_selectors[resource_of(kind)] = selector


@dataclass(frozen=True)
class Children:
    """The children the watches report, by (kind, namespace, name); a `ChildIndex`.
    `watched`: the kinds kopf watches (PodMonitor only when its CRD was there at startup)."""

    by_kind: Mapping[str, kopf.Index[tuple[str, str], CachedChild]]
    watched: frozenset[str]

    def watches(self, kind: kinds.Kind) -> bool:
        return kind.kind in self.watched

    def get(self, key: ChildKey) -> CachedChild | None:
        kind, namespace, name = key
        record: CachedChild | None = _first(self.by_kind[kind].get((namespace, name)))
        return record


@dataclass(frozen=True)
class Indices:
    """The indices of one handler call."""

    worker_pods: kopf.Index[tuple[str, str], PodSummary]
    pod_workers: kopf.Index[tuple[str, str], str]
    worker_metadata: kopf.Index[tuple[str, str], DynamoWorkerMetadata]
    dynamo_workers: kopf.Index[str, WorkerInfo]
    lora_adapters: kopf.Index[str, AdapterRef]
    children_by_kind: Mapping[str, kopf.Index[tuple[str, str], CachedChild]]

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Indices:
        """The indices among a handler's keyword arguments."""
        return cls(
            worker_pods=kwargs["worker_pods"],
            pod_workers=kwargs["pod_workers"],
            worker_metadata=kwargs["worker_metadata"],
            dynamo_workers=kwargs["dynamo_workers"],
            lora_adapters=kwargs["lora_adapters"],
            children_by_kind={k.kind: kwargs[child_index_id(k)] for k in CHILD_KINDS},
        )

    def children(self, watched: frozenset[str]) -> Children:
        """The DynamoWorkers' children, of the `watched` kinds."""
        return Children(self.children_by_kind, watched)

    def pods(self, namespace: str, worker: str) -> list[PodSummary]:
        """The pods of the DynamoWorker `worker` (both roles' of a disaggregated one)."""
        return list(self.worker_pods.get((namespace, worker), []))

    def metadata(
        self, namespace: str, pods: Sequence[PodSummary]
    ) -> dict[str, DynamoWorkerMetadata]:
        """The DynamoWorkerMetadata of `pods`, by pod name."""
        return metadata_by_pod(pods, lambda pod: _first(self.worker_metadata.get((namespace, pod))))

    def worker_of_pod(self, namespace: str, pod: str) -> str | None:
        """The DynamoWorker of the pod named `pod` (a DynamoWorkerMetadata's name too)."""
        worker: str | None = _first(self.pod_workers.get((namespace, pod)))
        return worker

    def workers(self, namespace: str) -> list[WorkerInfo]:
        """The namespace's DynamoWorkers."""
        return list(self.dynamo_workers.get(namespace, []))

    def adapters(self, namespace: str) -> list[AdapterRef]:
        """The namespace's readable LoRAAdapters."""
        return list(self.lora_adapters.get(namespace, []))

    def adapter_pods(self, namespace: str, worker: str) -> list[Pod]:
        """The pods of the DynamoWorker `worker` as a LoRAAdapter's plan sees them."""
        return [Pod.of(p, worker) for p in self.pods(namespace, worker)]

    def adapter_view(self, namespace: str) -> NamespaceView:
        """The namespace as a LoRAAdapter's reconcile reads it."""
        return NamespaceView(
            workers=self.workers(namespace),
            pods_of=partial(self.adapter_pods, namespace),
            adapters=self.adapters(namespace),
        )


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the indices on `registry`."""

    @kopf.index("v1", "pods", id="worker_pods", when=is_worker_pod, registry=registry)
    async def worker_pods(
        body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> dict[tuple[str, str], PodSummary]:
        worker = worker_of(labels)  # never None: is_worker_pod filters
        return {(namespace_of(namespace), worker): PodSummary.from_pod(body)} if worker else {}

    @kopf.index("v1", "pods", id="pod_workers", when=is_worker_pod, registry=registry)
    async def pod_workers(
        name: str, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> dict[tuple[str, str], str]:
        worker = worker_of(labels)
        return {(namespace_of(namespace), name): worker} if worker else {}

    @kopf.index(*DWM, id="worker_metadata", registry=registry)
    async def worker_metadata(
        body: kopf.Body, name: str, namespace: str | None, **_: Any
    ) -> dict[tuple[str, str], DynamoWorkerMetadata]:
        try:
            record = DynamoWorkerMetadata.model_validate(dict(body))
            return {(namespace_of(namespace), name): record}
        except ValidationError as err:
            log.warning("Ignoring unreadable DynamoWorkerMetadata %s: %s", name, err)
            return {}

    @kopf.index(*DW, id="dynamo_workers", registry=registry)
    async def dynamo_workers(
        name: str, namespace: str | None, labels: kopf.Labels, spec: kopf.Spec, **_: Any
    ) -> dict[str, WorkerInfo]:
        return {namespace_of(namespace): WorkerInfo.of(name, labels, spec)}

    @kopf.index(*LORA, id="lora_adapters", registry=registry)
    async def lora_adapters(
        body: kopf.Body, name: str, namespace: str | None, **_: Any
    ) -> dict[str, AdapterRef]:
        try:
            ref = AdapterRef.of_body(body)
        except ValidationError as err:
            log.warning("Ignoring unreadable LoRAAdapter %s: %s", name, err)
            return {}
        return {namespace_of(namespace): ref}

    for kind in CHILD_KINDS:
        _register_child_index(registry, kind)


def _register_child_index(registry: kopf.OperatorRegistry, kind: kinds.Kind) -> None:
    @kopf.index(*resource_of(kind), id=child_index_id(kind), labels=MANAGED, registry=registry)
    async def child(
        body: kopf.Body, name: str, namespace: str | None, **_: Any
    ) -> dict[tuple[str, str], CachedChild]:
        return {(namespace_of(namespace), name): CachedChild.of(body)}
