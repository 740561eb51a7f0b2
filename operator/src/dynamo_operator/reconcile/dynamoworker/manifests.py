"""The pieces every child of a DynamoWorker is built from (pure): its identity, the metadata,
labels and owner reference of a child, env and scheduling from the pod overrides, security
contexts, and the Deployment, Service port, ServiceAccount, Role, RoleBinding and PodMonitor
shapes the worker's children (`builders`) and the frontend's (`frontend`) share.
"""

from __future__ import annotations

from typing import Any

from dynamo_operator.api.dynamoworker import DynamoWorker, DynamoWorkerSpec
from dynamo_operator.api.pod import PodOverrides
from dynamo_operator.pods import routes
from dynamo_operator.reconcile.dynamoworker import interface as wi
from dynamo_operator.reconcile.dynamoworker.interface import Env
from dynamo_operator.reconcile.dynamoworker.labels import common_labels, owner_reference
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError

Manifest = dict[str, Any]

POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
REVISION_HISTORY_LIMIT = 3
VOLUME_TMP = "tmp"


def identity(dw: DynamoWorker) -> tuple[str, str, str]:
    """The DynamoWorker's name, namespace and uid (the API server has set all three)."""
    meta = dw.metadata
    if not meta.name or not meta.namespace or not meta.uid:
        raise SpecError("the DynamoWorker has no metadata.name, namespace or uid (not stored yet)")
    return meta.name, meta.namespace, meta.uid


def object_metadata(
    dw: DynamoWorker, name: str, extra_labels: dict[str, str] | None = None
) -> Manifest:
    """A child's metadata: its name, the common labels (and `extra_labels`), and the owner
    reference that makes it go with the DynamoWorker."""
    worker, namespace, uid = identity(dw)
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**common_labels(worker), **(extra_labels or {})},
        "ownerReferences": [owner_reference(worker, uid)],
    }


def secret_env(name: str, secret: str, key: str) -> Manifest:
    # Only the reference travels: the kubelet reads the Secret when it starts the container.
    return {"name": str(name), "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def credential_env(spec: DynamoWorkerSpec) -> list[Manifest]:
    """The env of spec.credentials: Secret references and the S3 endpoint settings."""
    credentials = spec.credentials
    if credentials is None:
        return []
    env: list[Manifest] = []
    s3 = credentials.s3
    if s3 is not None:
        env.append(secret_env(Env.AWS_ACCESS_KEY_ID, s3.secret_name, s3.access_key_id_key))
        env.append(secret_env(Env.AWS_SECRET_ACCESS_KEY, s3.secret_name, s3.secret_access_key_key))
        if s3.session_token_key is not None:
            env.append(secret_env(Env.AWS_SESSION_TOKEN, s3.secret_name, s3.session_token_key))
        if s3.endpoint is not None:
            env.append({"name": str(Env.AWS_ENDPOINT_URL), "value": s3.endpoint})
            if s3.endpoint.startswith("http://"):
                # The downloader refuses plain HTTP unless told; the user chose this endpoint.
                env.append({"name": str(Env.AWS_ALLOW_HTTP), "value": "true"})
        if s3.region is not None:
            env.append({"name": str(Env.AWS_REGION), "value": s3.region})
    hf = credentials.hugging_face
    if hf is not None:
        env.append(secret_env(Env.HF_TOKEN, hf.secret_name, hf.token_key))
    return env


def wants_pod_monitor(spec: DynamoWorkerSpec, settings: ReconcileSettings) -> bool:
    """Whether the worker should have a PodMonitor (Enabled always asks for one, even when the
    CRD is missing: the status then says so)."""
    mode = spec.metrics.pod_monitor
    return mode == "Enabled" or (mode == "Auto" and settings.pod_monitor_crd)


def scrape_annotations(
    spec: DynamoWorkerSpec, settings: ReconcileSettings, port: int
) -> dict[str, str]:
    """prometheus.io annotations (metrics on `port`), the fallback for scrapers configured by
    annotation."""
    if spec.metrics.pod_monitor != "Auto" or settings.pod_monitor_crd:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": routes.METRICS_PATH,
    }


def quantity(value: int | str) -> str:
    return str(value)


def user_env(overrides: PodOverrides | None, field: str, reserved: set[str]) -> list[Manifest]:
    """The env of `overrides` (at `field`, e.g. spec.pod), refusing names the operator sets."""
    if overrides is None:
        return []
    clashes = sorted(e.name for e in overrides.env if e.name in reserved)
    if clashes:
        raise SpecError(
            f"{field}.env sets {', '.join(clashes)}, which the operator sets from the spec; "
            "remove them (use the matching spec field instead)"
        )
    return [e.to_dict() for e in overrides.env]


def scheduling(overrides: PodOverrides | None) -> Manifest:
    """The pod-spec fields a pod block may add: node selector, tolerations, affinity, priority."""
    if overrides is None:
        return {}
    out: Manifest = {}
    if overrides.node_selector:
        out["nodeSelector"] = dict(overrides.node_selector)
    if overrides.tolerations:
        out["tolerations"] = [t.to_dict() for t in overrides.tolerations]
    if overrides.affinity:
        out["affinity"] = overrides.affinity
    if overrides.priority_class_name:
        out["priorityClassName"] = overrides.priority_class_name
    return out


def pod_metadata(
    overrides: PodOverrides | None, labels: Manifest, annotations: Manifest
) -> Manifest:
    """Template metadata: the pod block's labels and annotations under the operator's own."""
    pod_labels = {**(overrides.labels if overrides else {}), **labels}
    pod_annotations = {**(overrides.annotations if overrides else {}), **annotations}
    metadata: Manifest = {"labels": pod_labels}
    if pod_annotations:
        metadata["annotations"] = pod_annotations
    return metadata


def downward_env() -> list[Manifest]:
    return [
        {"name": str(name), "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in wi.DOWNWARD_ENV.items()
    ]


CONTAINER_SECURITY_CONTEXT: Manifest = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


POD_SECURITY_CONTEXT: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": wi.RUN_AS_USER,
    "runAsGroup": wi.RUN_AS_GROUP,
    "fsGroup": wi.RUN_AS_GROUP,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def deployment(
    dw: DynamoWorker,
    name: str,
    replicas: int,
    selector: Manifest,
    template: Manifest,
    labels: Manifest | None = None,
) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(dw, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # Surge one pod and never go below the ready count: a model server takes long to
            # load, so a rollout should not drop serving capacity while the new pod loads
            # (and the frontend keeps serving while a new one starts).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
            "template": template,
        },
    }


def serving_ports() -> list[Manifest]:
    """The container ports of a worker pod (and of the activator, which stands in for it):
    the system port and the OpenAI HTTP port."""
    return [
        {"name": routes.SYSTEM_PORT_NAME, "containerPort": routes.SYSTEM_PORT, "protocol": "TCP"},
        {"name": wi.HTTP_PORT_NAME, "containerPort": wi.HTTP_PORT, "protocol": "TCP"},
    ]


def service_port(name: str, port: int) -> Manifest:
    """A TCP Service port forwarding to the container port of the same name."""
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


def service_account(dw: DynamoWorker, name: str, labels: Manifest | None = None) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_metadata(dw, name, labels),
    }


def role(
    dw: DynamoWorker, name: str, rules: list[Manifest], labels: Manifest | None = None
) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_metadata(dw, name, labels),
        "rules": rules,
    }


def role_binding(dw: DynamoWorker, name: str, labels: Manifest | None = None) -> Manifest:
    """Grants the Role `name` to the ServiceAccount `name`."""
    _, namespace, _ = identity(dw)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_metadata(dw, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }


def pod_monitor(
    dw: DynamoWorker, name: str, selector: Manifest, port_name: str, labels: Manifest | None = None
) -> Manifest:
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": object_metadata(dw, name, labels),
        "spec": {
            "selector": {"matchLabels": selector},
            "podMetricsEndpoints": [{"port": port_name, "path": routes.METRICS_PATH}],
        },
    }
