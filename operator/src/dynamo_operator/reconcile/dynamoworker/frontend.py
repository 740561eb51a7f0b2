"""Pure builders of upstream's frontend for a DynamoWorker with spec.frontend: its identity and
read-only discovery permissions, its Service, its Deployment, and a PodMonitor when the
workers get one.
"""

from __future__ import annotations

from dynamo_operator.api import metadata as dwm
from dynamo_operator.api.dynamoworker import DynamoWorker, Frontend
from dynamo_operator.pods import routes
from dynamo_operator.reconcile.dynamoworker import interface as wi
from dynamo_operator.reconcile.dynamoworker import manifests as m
from dynamo_operator.reconcile.dynamoworker.interface import Env, FrontendEnv
from dynamo_operator.reconcile.dynamoworker.labels import (
    frontend_labels,
    frontend_name,
    frontend_selector_labels,
)
from dynamo_operator.reconcile.dynamoworker.manifests import Manifest
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError

FRONTEND_COMPONENT = {"app.kubernetes.io/component": "frontend"}

# What upstream's frontend reads from the API (its Kubernetes discovery): the EndpointSlices
# that say which worker pods are ready, and the DynamoWorkerMetadata records they publish.
FRONTEND_ROLE_RULES: list[Manifest] = [
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [dwm.GROUP], "resources": [dwm.PLURAL], "verbs": ["list", "watch"]},
]


def frontend_image(frontend: Frontend, settings: ReconcileSettings) -> str:
    """spec.frontend.image, else the operator's default frontend image."""
    image = frontend.image or settings.frontend_image
    if not image:
        raise SpecError(
            "spec.frontend.image is unset and the operator has no default frontend image; set "
            "spec.frontend.image or run the operator with --frontend-image"
        )
    return image


def frontend_url(dw: DynamoWorker) -> str:
    """The frontend's OpenAI base URL inside the cluster (its Service's DNS name)."""
    worker, namespace, _ = m.identity(dw)
    return f"http://{frontend_name(worker)}.{namespace}.svc:{wi.FRONTEND_PORT}"


def _frontend_env(dw: DynamoWorker, frontend: Frontend) -> list[Manifest]:
    worker, namespace, _ = m.identity(dw)
    plain: list[tuple[str, str]] = [
        # Scopes discovery to this DynamoWorker's workers (their DYN_NAMESPACE).
        (FrontendEnv.NAMESPACE, wi.dynamo_namespace(namespace, worker)),
        (FrontendEnv.DISCOVERY_BACKEND, wi.DISCOVERY_BACKEND),
        (FrontendEnv.REQUEST_PLANE, wi.REQUEST_PLANE),
        (FrontendEnv.HTTP_PORT, str(wi.FRONTEND_PORT)),
        (FrontendEnv.ROUTER_MODE, frontend.router_mode),
        # The frontend caches model-card files under $HOME; the root filesystem is read-only.
        (Env.HOME, wi.TMP_PATH),
    ]
    env: list[Manifest] = [{"name": str(name), "value": value} for name, value in plain]
    return env + m.downward_env()


def _frontend_resources(frontend: Frontend) -> Manifest:
    res = frontend.resources
    out: Manifest = {}
    if res.cpu is not None:
        out.setdefault("requests", {})["cpu"] = m.quantity(res.cpu)
    if res.memory is not None:
        out.setdefault("requests", {})["memory"] = m.quantity(res.memory)
        out["limits"] = {"memory": m.quantity(res.memory)}
    return out


def desired_frontend_deployment(
    dw: DynamoWorker, frontend: Frontend, settings: ReconcileSettings
) -> Manifest:
    """The Deployment of frontend pods (container `main` running upstream's frontend)."""
    worker, _, _ = m.identity(dw)
    name = frontend_name(worker)
    env = _frontend_env(dw, frontend)
    env += m.user_env(frontend.pod, "spec.frontend.pod", {e["name"] for e in env})
    probe_port = {"port": wi.FRONTEND_PORT_NAME}
    container: Manifest = {
        "name": wi.CONTAINER_NAME,
        "image": frontend_image(frontend, settings),
        "command": list(frontend.command or wi.FRONTEND_COMMAND),
        "ports": [
            {"name": wi.FRONTEND_PORT_NAME, "containerPort": wi.FRONTEND_PORT, "protocol": "TCP"}
        ],
        "env": env,
        "livenessProbe": {
            "httpGet": {"path": routes.LIVE_PATH, **probe_port},
            **wi.FRONTEND_LIVENESS,
        },
        "readinessProbe": {
            "httpGet": {"path": routes.HEALTH_PATH, **probe_port},
            **wi.FRONTEND_READINESS,
        },
        "securityContext": dict(m.CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": m.VOLUME_TMP, "mountPath": wi.TMP_PATH}],
    }
    if frontend.extra_args:
        container["args"] = list(frontend.extra_args)
    resources = _frontend_resources(frontend)
    if resources:
        container["resources"] = resources
    if frontend.image_pull_policy is not None:
        container["imagePullPolicy"] = frontend.image_pull_policy
    pod_spec: Manifest = {
        "serviceAccountName": name,
        # The frontend watches EndpointSlices and DynamoWorkerMetadata with its token.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": dict(m.POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [{"name": m.VOLUME_TMP, "emptyDir": {}}],
        **m.scheduling(frontend.pod),
    }
    if settings.worker_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.worker_image_pull_secrets]
    template_metadata = m.pod_metadata(
        frontend.pod,
        frontend_labels(worker),
        m.scrape_annotations(dw.spec, settings, wi.FRONTEND_PORT),
    )
    return m.deployment(
        dw,
        name,
        frontend.replicas,
        frontend_selector_labels(worker),
        {"metadata": template_metadata, "spec": pod_spec},
        FRONTEND_COMPONENT,
    )


def desired_frontend_service(dw: DynamoWorker) -> Manifest:
    """The frontend's ClusterIP Service: the address clients (or an Ingress) use."""
    worker, _, _ = m.identity(dw)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": m.object_metadata(dw, frontend_name(worker), FRONTEND_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": frontend_selector_labels(worker),
            "ports": [m.service_port(wi.FRONTEND_PORT_NAME, wi.FRONTEND_PORT)],
        },
    }


def desired_frontend_children(dw: DynamoWorker, settings: ReconcileSettings) -> list[Manifest]:
    """The frontend's children in apply order (none when spec.frontend is unset): its
    identity and read-only discovery permissions, its Service, its Deployment, and a
    PodMonitor on its OpenAI port when the workers get one (spec.metrics)."""
    frontend = dw.spec.frontend
    if frontend is None:
        return []
    worker = m.identity(dw)[0]
    name = frontend_name(worker)
    children = [
        m.service_account(dw, name, FRONTEND_COMPONENT),
        m.role(dw, name, FRONTEND_ROLE_RULES, FRONTEND_COMPONENT),
        m.role_binding(dw, name, FRONTEND_COMPONENT),
        desired_frontend_service(dw),
        desired_frontend_deployment(dw, frontend, settings),
    ]
    if m.wants_pod_monitor(dw.spec, settings) and settings.pod_monitor_crd:
        children.append(
            m.pod_monitor(
                dw,
                name,
                frontend_selector_labels(worker),
                wi.FRONTEND_PORT_NAME,
                FRONTEND_COMPONENT,
            )
        )
    return children
