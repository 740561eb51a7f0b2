"""Names, labels and annotations of a DynamoWorker's children.

Children get deterministic names derived from the DynamoWorker's name, so a re-run after a
crash finds (and applies over) what an earlier run created instead of making a second copy.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynamo_operator.api.common import API_VERSION
from dynamo_operator.api.dynamoworker import PREFILL, WorkerRole

PREFIX = "dynamo.dev/"
WORKER_LABEL = f"{PREFIX}worker"
# On the prefill pods of a disaggregated worker (spec.prefill), in place of the worker label:
# the decode (worker) Deployment's selector, immutable, must never take them, and
# status.selector (the scale subresource) counts decode pods only.
PREFILL_LABEL = f"{PREFIX}prefill"
# On the pods of a disaggregated worker: prefill or decode (never on an aggregated worker's).
ROLE_LABEL = f"{PREFIX}role"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "dynamo-operator"
COMPONENT_LABEL = "app.kubernetes.io/component"
WORKER_COMPONENT = "worker"
PART_OF = "dynamo"
# Upstream Dynamo's Kubernetes discovery lists a worker only while its pod is Ready behind an
# EndpointSlice carrying these labels (the EndpointSlice controller copies them from the
# Service); the pod template carries them too, as upstream's operator does.
DISCOVERY_LABELS = {
    "nvidia.com/dynamo-discovery-backend": "kubernetes",
    "nvidia.com/dynamo-discovery-enabled": "true",
}
OWNER_KIND = "DynamoWorker"
# The pod readiness gate for LoRAAdapters with requiredForReadiness: worker pods carry it
# while such an adapter targets their DynamoWorker, and the operator sets the condition per
# pod (True once every such adapter is loaded there).
ADAPTERS_READY_GATE = f"{PREFIX}lora-adapters-ready"


def common_labels(worker: str) -> dict[str, str]:
    """Labels on every child of the DynamoWorker named `worker`."""
    return {
        "app.kubernetes.io/name": "dynamo-worker",
        "app.kubernetes.io/instance": worker,
        COMPONENT_LABEL: WORKER_COMPONENT,
        "app.kubernetes.io/part-of": PART_OF,
        MANAGED_BY_LABEL: MANAGED_BY,
        WORKER_LABEL: worker,
    }


FRONTEND_LABEL = f"{PREFIX}frontend"
# On the operator's own pods (the chart sets it): the worker pods' NetworkPolicy admits them.
OPERATOR_LABEL = f"{PREFIX}operator"
# On the pods of the fill and prune Jobs of spec.model.cache (value: the DynamoWorker).
CACHE_POD_LABEL = f"{PREFIX}model-cache"


def frontend_labels(worker: str) -> dict[str, str]:
    """Labels on the frontend's pods: the common ones, but never the worker label, so no worker
    selector (the Deployment's, the Service's, the PDB's, the operator's pod index) takes a
    frontend pod for a worker."""
    labels = common_labels(worker)
    del labels[WORKER_LABEL]
    return {**labels, "app.kubernetes.io/component": "frontend", FRONTEND_LABEL: worker}


ACTIVATOR_LABEL = f"{PREFIX}activator"
# On the activator's EndpointSlice while spec.replicas is 0: the activator's cue to step in
# while the last pod still serves (`dynamo.activator.pods` reads it by the same name).
SCALED_TO_ZERO_ANNOTATION = f"{PREFIX}scaled-to-zero"


def activator_labels(worker: str) -> dict[str, str]:
    """Labels on the activator's pods: never the worker label (no worker selector may take
    the activator for a worker pod; it joins the worker Service through its own
    EndpointSlice instead)."""
    labels = common_labels(worker)
    del labels[WORKER_LABEL]
    return {**labels, "app.kubernetes.io/component": "activator", ACTIVATOR_LABEL: worker}


def activator_selector_labels(worker: str) -> dict[str, str]:
    return {ACTIVATOR_LABEL: worker}


def activator_name(worker: str) -> str:
    """The activator's Deployment, ServiceAccount, Role, RoleBinding, NetworkPolicy and the
    EndpointSlice that makes it an endpoint of the worker Service."""
    return f"{worker}-activator"


def worker_pod_labels(worker: str, role: WorkerRole | None = None) -> dict[str, str]:
    """Labels on the pods of `role` (None: an aggregated worker's pods): the common ones, the
    prefill label in place of the worker label on prefill pods, and the role on both roles'."""
    labels = common_labels(worker)
    if role is None:
        return labels
    if role == PREFILL:
        del labels[WORKER_LABEL]
    return {**labels, **selector_labels(worker, role), ROLE_LABEL: role}


def worker_of(labels: Mapping[str, str]) -> str | None:
    """The DynamoWorker of a pod with these labels, either role; None: not a worker pod."""
    return labels.get(WORKER_LABEL) or labels.get(PREFILL_LABEL)


def frontend_selector_labels(worker: str) -> dict[str, str]:
    """The labels that select the frontend's pods (immutable, like the workers')."""
    return {FRONTEND_LABEL: worker}


def selector_labels(worker: str, role: WorkerRole | None = None) -> dict[str, str]:
    """The labels that select the worker's pods (the decode pods of a disaggregated worker;
    its prefill pods with `role` prefill). A Deployment's selector is immutable, so this
    stays one label that never changes for a given DynamoWorker and role."""
    if role == PREFILL:
        return {PREFILL_LABEL: worker}
    return {WORKER_LABEL: worker}


def selector_string(worker: str) -> str:
    """The pod selector as a label-selector string (status.selector, for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(worker).items()))


def _role_name(worker: str, role: WorkerRole | None) -> str:
    """The name of a child of the pods of `role`: the prefill pods' children are suffixed."""
    return f"{worker}-{PREFILL}" if role == PREFILL else worker


def deployment_name(worker: str, role: WorkerRole | None = None) -> str:
    return _role_name(worker, role)


def service_name(worker: str, role: WorkerRole | None = None) -> str:
    return _role_name(worker, role)


def pdb_name(worker: str, role: WorkerRole | None = None) -> str:
    return _role_name(worker, role)


def pod_monitor_name(worker: str, role: WorkerRole | None = None) -> str:
    return _role_name(worker, role)


def network_policy_name(worker: str, role: WorkerRole | None = None) -> str:
    return _role_name(worker, role)


def service_account_name(worker: str) -> str:
    """The worker pods' ServiceAccount; its Role and RoleBinding share the name."""
    return f"{worker}-worker"


def frontend_name(worker: str) -> str:
    """The frontend's Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return f"{worker}-frontend"


def model_cache_claim_name(worker: str, existing: str | None = None) -> str:
    """The PersistentVolumeClaim of spec.model.cache: the existing one it names (claimName),
    else the one the operator creates."""
    return existing or f"{worker}-model-cache"


# The fill and prune Jobs' names carry this many hex digits of the cache key: with the longest
# worker name (50) and "-prune-", a name stays a valid label value (63), which the Job
# controller puts on their pods.
FILL_KEY_DIGITS = 6


def fill_job_name(worker: str, key: str) -> str:
    """The Job that fills the model cache for the cache key `key`."""
    return f"{worker}-fill-{key[:FILL_KEY_DIGITS]}"


def prune_job_name(worker: str, key: str) -> str:
    """The Job that removes every cache directory but `key`'s from the operator's claim."""
    return f"{worker}-prune-{key[:FILL_KEY_DIGITS]}"


def cache_pod_labels(worker: str) -> dict[str, str]:
    """Labels of the model cache Jobs' pods: not the worker label, so nothing takes them for
    workers."""
    return {
        "app.kubernetes.io/name": "dynamo-model-cache",
        "app.kubernetes.io/instance": worker,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        CACHE_POD_LABEL: worker,
    }


def owner_reference(name: str, uid: str) -> dict[str, object]:
    """The reference that makes the garbage collector delete a child with its DynamoWorker."""
    return {
        "apiVersion": API_VERSION,
        "kind": OWNER_KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
