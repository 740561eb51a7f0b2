"""Pure builders of the activator of a DynamoWorker that may scale to zero
(spec.autoscaling.minReplicas 0).

The activator (`dynamo-activator`, from the worker image) stands in for the worker pods while
there are none: it holds requests, the autoscaler sees them as demand and starts a pod, and
the activator forwards each request to the first ready pod. One small CPU pod per such
DynamoWorker, made by the operator rather than one shared Deployment in the chart, because:

- it joins the worker Service through an EndpointSlice of its own in the worker's namespace
  (`<worker>-activator`, labelled with the Service's name and upstream's discovery labels),
  so clients of the Service and upstream's frontend reach it with nothing rewired; a shared
  activator would need write access to EndpointSlices and discovery records in every
  namespace;
- its permissions are one namespace's, and a fault (a flood of held requests) stays within
  one DynamoWorker.

The operator creates the EndpointSlice with no endpoints; the activator's Role may patch that
one slice (by name) to add or withdraw its own address, and nothing else of the Service.
While spec.replicas is 0 the operator marks that slice (`SCALED_TO_ZERO_ANNOTATION`), which
the activator already watches: it steps in at once, and its endpoint turning ready there is
what lets the last worker pod go (see `handover`).
"""

from __future__ import annotations

from dynamo_operator.api import metadata as dwm
from dynamo_operator.api.autoscaling import Autoscaling
from dynamo_operator.api.dynamoworker import DynamoWorker
from dynamo_operator.pods import routes
from dynamo_operator.reconcile.dynamoworker import interface as wi
from dynamo_operator.reconcile.dynamoworker import manifests as m
from dynamo_operator.reconcile.dynamoworker.labels import (
    DISCOVERY_LABELS,
    SCALED_TO_ZERO_ANNOTATION,
    activator_labels,
    activator_name,
    activator_selector_labels,
    service_name,
)
from dynamo_operator.reconcile.dynamoworker.manifests import Manifest
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError

ACTIVATOR_COMPONENT = {"app.kubernetes.io/component": "activator"}
ACTIVATOR_COMMAND = ["dynamo-activator"]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
ACTIVATOR_MANAGER = "dynamo-activator"
# The activator holds connections, not a model: a small pod.
ACTIVATOR_RESOURCES: Manifest = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    "limits": {"memory": "512Mi"},
}
ACTIVATOR_READY_PATH = "/ready"


def wants_activator(dw: DynamoWorker) -> bool:
    """Whether the DynamoWorker may scale to zero (and so needs an activator)."""
    autoscaling = dw.spec.autoscaling
    return autoscaling is not None and autoscaling.min_replicas == 0


def activator_image(settings: ReconcileSettings) -> str:
    """The operator's worker image: the activator runs the runtime, never an engine."""
    if not settings.worker_image:
        raise SpecError(
            "spec.autoscaling.minReplicas 0 needs the activator, which runs from the "
            "operator's worker image; run the operator with --worker-image"
        )
    return settings.worker_image


def _role_rules(worker: str) -> list[Manifest]:
    """What the activator does with the API: watch the worker's EndpointSlices and
    DynamoWorkerMetadata (which pods are ready, what they serve), patch its own
    EndpointSlice only, and write its own DynamoWorkerMetadata (a Role cannot name an object
    that does not exist yet for `create`, so that rule covers the kind, as the workers' does)."""
    return [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "resourceNames": [activator_name(worker)],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": [dwm.GROUP],
            "resources": [dwm.PLURAL],
            "verbs": ["get", "list", "watch", "create", "patch", "delete"],
        },
    ]


def desired_activator_deployment(
    dw: DynamoWorker, autoscaling: Autoscaling, settings: ReconcileSettings
) -> Manifest:
    """One activator pod (container `main` running `dynamo-activator`)."""
    worker, _, _ = m.identity(dw)
    name = activator_name(worker)
    plain = [
        ("DYN_ACTIVATOR_WORKER", worker),
        ("DYN_ACTIVATOR_MAX_HELD", str(autoscaling.max_held_requests)),
        ("DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS", str(autoscaling.hold_timeout_seconds)),
        (str(wi.Env.SYSTEM_PORT), str(routes.SYSTEM_PORT)),
        (str(wi.Env.HTTP_PORT), str(wi.HTTP_PORT)),
        (str(wi.Env.HOME), wi.TMP_PATH),
    ]
    env: list[Manifest] = [{"name": k, "value": v} for k, v in plain] + m.downward_env()
    overrides = autoscaling.activator_pod
    env += m.user_env(overrides, "spec.autoscaling.activatorPod", {e["name"] for e in env})
    probe = {"port": routes.SYSTEM_PORT_NAME}
    container: Manifest = {
        "name": wi.CONTAINER_NAME,
        "image": activator_image(settings),
        "command": list(ACTIVATOR_COMMAND),
        "ports": m.serving_ports(),
        "env": env,
        "resources": ACTIVATOR_RESOURCES,
        # It listens within a second of its start and loads no model: no startup probe, and
        # the frontend's tolerant timings (three misses before a restart).
        "livenessProbe": {
            "httpGet": {"path": routes.HEALTH_PATH, **probe},
            **wi.FRONTEND_LIVENESS,
        },
        "readinessProbe": {
            "httpGet": {"path": ACTIVATOR_READY_PATH, **probe},
            **wi.FRONTEND_READINESS,
        },
        "securityContext": dict(m.CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": m.VOLUME_TMP, "mountPath": wi.TMP_PATH}],
    }
    pod_spec: Manifest = {
        "serviceAccountName": name,
        # It watches the worker's EndpointSlices and writes its own record with its token.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        # Held requests are answered 503 on SIGTERM; a few seconds cover it.
        "terminationGracePeriodSeconds": 10,
        "securityContext": dict(m.POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [{"name": m.VOLUME_TMP, "emptyDir": {}}],
        **m.scheduling(overrides),
    }
    if settings.worker_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.worker_image_pull_secrets]
    return m.deployment(
        dw,
        name,
        1,
        activator_selector_labels(worker),
        {"metadata": m.pod_metadata(overrides, activator_labels(worker), {}), "spec": pod_spec},
        ACTIVATOR_COMPONENT,
    )


def desired_activator_endpoint_slice(dw: DynamoWorker) -> Manifest:
    """The worker Service's EndpointSlice for the activator, made empty: the activator adds
    its own address while it stands in for the pods (its field manager owns `endpoints`).
    Marked scaled to zero while spec.replicas is 0."""
    worker, _, _ = m.identity(dw)
    labels = {
        **ACTIVATOR_COMPONENT,
        **DISCOVERY_LABELS,
        SERVICE_NAME_LABEL: service_name(worker),
        MANAGED_BY_LABEL: ACTIVATOR_MANAGER,
    }
    metadata = m.object_metadata(dw, activator_name(worker), labels)
    if dw.spec.replicas == 0:
        metadata["annotations"] = {SCALED_TO_ZERO_ANNOTATION: "true"}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": metadata,
        "addressType": "IPv4",
        "ports": [
            {"name": routes.SYSTEM_PORT_NAME, "port": routes.SYSTEM_PORT, "protocol": "TCP"},
            {"name": wi.HTTP_PORT_NAME, "port": wi.HTTP_PORT, "protocol": "TCP"},
        ],
    }


def activator_ip(slice_: Manifest | None) -> str | None:
    """The activator's address in its EndpointSlice (None: it has not published one)."""
    for endpoint in (slice_ or {}).get("endpoints") or []:
        addresses = endpoint.get("addresses") or []
        if addresses:
            return str(addresses[0])
    return None


def activator_ready(slice_: Manifest | None) -> bool:
    """Whether the activator stands in: its endpoint in its EndpointSlice is ready (it marks
    it so once its discovery record is published)."""
    endpoints = (slice_ or {}).get("endpoints") or []
    return any((e.get("conditions") or {}).get("ready") is True for e in endpoints)


def desired_activator_children(dw: DynamoWorker, settings: ReconcileSettings) -> list[Manifest]:
    """The activator's children in apply order (none unless minReplicas is 0): identity and
    permissions, its EndpointSlice, its Deployment. Its NetworkPolicy is the builders'."""
    autoscaling = dw.spec.autoscaling
    if autoscaling is None or not wants_activator(dw):
        return []
    name = activator_name(m.identity(dw)[0])
    return [
        m.service_account(dw, name, ACTIVATOR_COMPONENT),
        m.role(dw, name, _role_rules(m.identity(dw)[0]), ACTIVATOR_COMPONENT),
        m.role_binding(dw, name, ACTIVATOR_COMPONENT),
        desired_activator_endpoint_slice(dw),
        desired_activator_deployment(dw, autoscaling, settings),
    ]
