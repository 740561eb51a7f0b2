"""The kinds the operator reads and writes, and their REST paths."""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_operator.api import metadata as dwm
from dynamo_operator.api.common import API_VERSION


@dataclass(frozen=True)
class Kind:
    """One resource kind: `api_version` as in manifests (`v1`, `apps/v1`), its plural."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def collection_path(self, namespace: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced:
            if namespace is None:
                raise ValueError(f"{self.kind} is namespaced: a namespace is needed")
            return f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{self.plural}"

    def path(self, namespace: str | None, name: str) -> str:
        return f"{self.collection_path(namespace)}/{name}"


DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
SERVICE = Kind("v1", "Service", "services")
SERVICE_ACCOUNT = Kind("v1", "ServiceAccount", "serviceaccounts")
POD_DISRUPTION_BUDGET = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
ROLE = Kind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
POD_MONITOR = Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors")
NETWORK_POLICY = Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
POD = Kind("v1", "Pod", "pods")
PERSISTENT_VOLUME_CLAIM = Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
JOB = Kind("batch/v1", "Job", "jobs")
ENDPOINT_SLICE = Kind("discovery.k8s.io/v1", "EndpointSlice", "endpointslices")
EVENT = Kind("events.k8s.io/v1", "Event", "events")
LEASE = Kind("coordination.k8s.io/v1", "Lease", "leases")
DYNAMO_WORKER = Kind(API_VERSION, "DynamoWorker", "dynamoworkers")
LORA_ADAPTER = Kind(API_VERSION, "LoRAAdapter", "loraadapters")
DYNAMO_WORKER_METADATA = Kind(dwm.API_VERSION, dwm.KIND, dwm.PLURAL)
CRD = Kind(
    "apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", False
)

ALL = (
    DEPLOYMENT,
    SERVICE,
    SERVICE_ACCOUNT,
    POD_DISRUPTION_BUDGET,
    ROLE,
    ROLE_BINDING,
    POD_MONITOR,
    NETWORK_POLICY,
    POD,
    PERSISTENT_VOLUME_CLAIM,
    JOB,
    ENDPOINT_SLICE,
    EVENT,
    DYNAMO_WORKER,
    LORA_ADAPTER,
    DYNAMO_WORKER_METADATA,
    CRD,
)
_BY_TYPE = {(k.api_version, k.kind): k for k in ALL}


def kind_of(manifest: dict[str, object]) -> Kind:
    """The Kind of a manifest (by apiVersion and kind)."""
    key = (str(manifest.get("apiVersion")), str(manifest.get("kind")))
    try:
        return _BY_TYPE[key]
    except KeyError:
        raise ValueError(f"unknown kind {key[1]} ({key[0]})") from None
