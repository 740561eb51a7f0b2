"""Pure builders: a DynamoWorker (and the operator's settings) in, the children's manifests out.

Each `desired_*` returns the complete manifest the operator server-side-applies: only the
fields it owns, no status, no server-filled defaults. No I/O here; unit tests compare the
output with golden files.
"""

from __future__ import annotations

from typing import Any

from dynamo_operator.api import metadata as dwm
from dynamo_operator.api.dynamoworker import DynamoWorker, DynamoWorkerSpec, Frontend
from dynamo_operator.api.pod import PodOverrides
from dynamo_operator.reconcile import interface as wi
from dynamo_operator.reconcile.errors import SpecError
from dynamo_operator.reconcile.interface import Env, FrontendEnv
from dynamo_operator.reconcile.labels import (
    ADAPTERS_READY_GATE,
    DISCOVERY_LABELS,
    common_labels,
    deployment_name,
    frontend_labels,
    frontend_name,
    frontend_selector_labels,
    owner_reference,
    pdb_name,
    pod_monitor_name,
    selector_labels,
    service_account_name,
    service_name,
)
from dynamo_operator.reconcile.settings import ReconcileSettings

Manifest = dict[str, Any]

GPU_RESOURCE = "nvidia.com/gpu"
POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
POD_MONITOR_CRD = "podmonitors.monitoring.coreos.com"
# A Deployment reports ProgressDeadlineExceeded after this long without progress. Pods may
# legitimately take the whole startup-probe budget to load a model, so the deadline covers
# that budget plus ten minutes for scheduling and image pulls.
PROGRESS_DEADLINE_SECONDS = wi.STARTUP_BUDGET_SECONDS + 600
REVISION_HISTORY_LIMIT = 3
WORKER_ROLE_VERBS = ["get", "create", "patch", "update", "delete"]
VOLUME_SHM, VOLUME_TMP, VOLUME_CACHE, VOLUME_LORA = "shm", "tmp", "cache", "lora-cache"
FRONTEND_COMPONENT = {"app.kubernetes.io/component": "frontend"}


def _identity(dw: DynamoWorker) -> tuple[str, str, str]:
    meta = dw.metadata
    if not meta.name or not meta.namespace or not meta.uid:
        raise SpecError("the DynamoWorker has no metadata.name, namespace or uid (not stored yet)")
    return meta.name, meta.namespace, meta.uid


def _metadata(dw: DynamoWorker, name: str, extra_labels: dict[str, str] | None = None) -> Manifest:
    worker, namespace, uid = _identity(dw)
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**common_labels(worker), **(extra_labels or {})},
        "ownerReferences": [owner_reference(worker, uid)],
    }


def wants_pod_monitor(spec: DynamoWorkerSpec, settings: ReconcileSettings) -> bool:
    """Whether the worker should have a PodMonitor (Enabled always asks for one, even when the
    CRD is missing: the status then says so)."""
    mode = spec.metrics.pod_monitor
    return mode == "Enabled" or (mode == "Auto" and settings.pod_monitor_crd)


def _scrape_annotations(
    spec: DynamoWorkerSpec, settings: ReconcileSettings, port: int
) -> dict[str, str]:
    """prometheus.io annotations (metrics on `port`), the fallback for scrapers configured by
    annotation."""
    if spec.metrics.pod_monitor != "Auto" or settings.pod_monitor_crd:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": wi.METRICS_PATH,
    }


def _quantity(value: int | str) -> str:
    return str(value)


def _worker_env(dw: DynamoWorker) -> list[Manifest]:
    worker, namespace, _ = _identity(dw)
    spec = dw.spec
    drain = spec.drain
    plain: list[tuple[str, str]] = [
        (Env.NAMESPACE, wi.dynamo_namespace(namespace, worker)),
        (Env.COMPONENT, wi.COMPONENT),
        (Env.SYSTEM_PORT, str(wi.SYSTEM_PORT)),
        (Env.HTTP_PORT, str(wi.HTTP_PORT)),
        (Env.DISCOVERY_BACKEND, wi.DISCOVERY_BACKEND),
        (Env.REQUEST_PLANE, wi.REQUEST_PLANE),
        (Env.LORA_ENABLED, "true" if spec.lora.enabled else "false"),
    ]
    max_loras = spec.lora.effective_max_loras
    if max_loras is not None:
        plain += [(Env.LORA_PATH, wi.LORA_PATH), (Env.MAX_LORAS, str(max_loras))]
    plain += [
        (Env.GRACE_PERIOD, str(drain.grace_period_seconds)),
        (Env.PREFILL_DRAIN_TIMEOUT, str(drain.drain_timeout_seconds)),
        (Env.SHUTDOWN_TIMEOUT, str(wi.shutdown_timeout_seconds(drain))),
    ]
    budget = spec.token_budget
    if budget is not None:
        plain += [
            (Env.TOKEN_BUDGET_COMBINED_LIMIT, str(budget.combined_limit)),
            (Env.TOKEN_BUDGET_REJECT_PROMPT, _bool(budget.reject_prompt_overflow)),
            (Env.TOKEN_BUDGET_REJECT_TOTAL, _bool(budget.reject_total_overflow)),
        ]
    plain += [(Env.HOME, wi.TMP_PATH), (Env.HF_HOME, wi.HF_HOME_PATH)]
    env: list[Manifest] = [{"name": str(name), "value": value} for name, value in plain]
    env += _downward_env()
    env += _credential_env(spec)
    return env


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _secret_env(name: str, secret: str, key: str) -> Manifest:
    # Only the reference travels: the kubelet reads the Secret when it starts the container.
    return {"name": str(name), "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _credential_env(spec: DynamoWorkerSpec) -> list[Manifest]:
    credentials = spec.credentials
    if credentials is None:
        return []
    env: list[Manifest] = []
    s3 = credentials.s3
    if s3 is not None:
        env.append(_secret_env(Env.AWS_ACCESS_KEY_ID, s3.secret_name, s3.access_key_id_key))
        env.append(_secret_env(Env.AWS_SECRET_ACCESS_KEY, s3.secret_name, s3.secret_access_key_key))
        if s3.session_token_key is not None:
            env.append(_secret_env(Env.AWS_SESSION_TOKEN, s3.secret_name, s3.session_token_key))
        if s3.endpoint is not None:
            env.append({"name": str(Env.AWS_ENDPOINT_URL), "value": s3.endpoint})
            if s3.endpoint.startswith("http://"):
                # The downloader refuses plain HTTP unless told; the user chose this endpoint.
                env.append({"name": str(Env.AWS_ALLOW_HTTP), "value": "true"})
        if s3.region is not None:
            env.append({"name": str(Env.AWS_REGION), "value": s3.region})
    hf = credentials.hugging_face
    if hf is not None:
        env.append(_secret_env(Env.HF_TOKEN, hf.secret_name, hf.token_key))
    return env


def _user_env(overrides: PodOverrides | None, field: str, reserved: set[str]) -> list[Manifest]:
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


def _scheduling(overrides: PodOverrides | None) -> Manifest:
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


def _pod_metadata(
    overrides: PodOverrides | None, labels: Manifest, annotations: Manifest
) -> Manifest:
    """Template metadata: the pod block's labels and annotations under the operator's own."""
    pod_labels = {**(overrides.labels if overrides else {}), **labels}
    pod_annotations = {**(overrides.annotations if overrides else {}), **annotations}
    metadata: Manifest = {"labels": pod_labels}
    if pod_annotations:
        metadata["annotations"] = pod_annotations
    return metadata


def _downward_env() -> list[Manifest]:
    return [
        {"name": str(name), "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in wi.DOWNWARD_ENV.items()
    ]


def _resources(spec: DynamoWorkerSpec) -> Manifest:
    res = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu is not None:
        requests["cpu"] = _quantity(res.cpu)
    if res.memory is not None:
        requests["memory"] = limits["memory"] = _quantity(res.memory)
    if res.gpus_per_pod > 0:
        # Extended resources must be requested and limited alike.
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(res.gpus_per_pod)
    out: Manifest = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(spec: DynamoWorkerSpec) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = [
        {
            "name": VOLUME_SHM,
            "emptyDir": {
                "medium": "Memory",
                "sizeLimit": _quantity(spec.resources.shared_memory_size),
            },
        },
        {"name": VOLUME_TMP, "emptyDir": {}},
        {"name": VOLUME_CACHE, "emptyDir": {}},
    ]
    mounts: list[Manifest] = [
        {"name": VOLUME_SHM, "mountPath": wi.SHM_PATH},
        {"name": VOLUME_TMP, "mountPath": wi.TMP_PATH},
        {"name": VOLUME_CACHE, "mountPath": wi.CACHE_PATH},
    ]
    if spec.lora.enabled:
        cache = spec.lora.cache
        if cache is not None and cache.persistent_volume_claim is not None:
            source: Manifest = {
                "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim.claim_name}
            }
        else:
            empty_dir: Manifest = {}
            size_limit = cache.empty_dir.size_limit if cache and cache.empty_dir else None
            if size_limit is not None:
                empty_dir["sizeLimit"] = _quantity(size_limit)
            source = {"emptyDir": empty_dir}
        volumes.append({"name": VOLUME_LORA, **source})
        mounts.append({"name": VOLUME_LORA, "mountPath": wi.LORA_PATH})
    return volumes, mounts


def _probe(path: str, timings: dict[str, int]) -> Manifest:
    return {"httpGet": {"path": path, "port": wi.SYSTEM_PORT_NAME}, **timings}


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


def worker_image(dw: DynamoWorker, settings: ReconcileSettings) -> str:
    """spec.image, else the operator's default worker image."""
    image = dw.spec.image or settings.worker_image
    if not image:
        raise SpecError(
            "spec.image is unset and the operator has no default worker image; set spec.image "
            "or run the operator with --worker-image"
        )
    return image


def desired_deployment(
    dw: DynamoWorker, settings: ReconcileSettings, *, adapters_gate: bool = False
) -> Manifest:
    """The Deployment of worker pods (container `main` running `dynamo-worker`); with the
    LoRA-adapters readiness gate when `adapters_gate` (see `reconcile.adapter_gate`)."""
    worker, _, _ = _identity(dw)
    spec = dw.spec
    env = _worker_env(dw)
    env += _user_env(spec.pod, "spec.pod", {e["name"] for e in env})
    volumes, mounts = _volumes(spec)
    container: Manifest = {
        "name": wi.CONTAINER_NAME,
        "image": worker_image(dw, settings),
        "command": list(wi.COMMAND),
        "args": wi.worker_args(spec),
        "ports": [
            {"name": wi.SYSTEM_PORT_NAME, "containerPort": wi.SYSTEM_PORT, "protocol": "TCP"},
            {"name": wi.HTTP_PORT_NAME, "containerPort": wi.HTTP_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "resources": _resources(spec),
        "startupProbe": _probe(wi.LIVE_PATH, wi.STARTUP),
        "livenessProbe": _probe(wi.LIVE_PATH, wi.LIVENESS),
        "readinessProbe": _probe(wi.HEALTH_PATH, wi.READINESS),
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": mounts,
    }
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: Manifest = {
        "serviceAccountName": service_account_name(worker),
        # The worker writes its own DynamoWorkerMetadata, so it needs its token.
        "automountServiceAccountToken": True,
        # Service links would add env for every Service in the namespace.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": wi.termination_grace_period_seconds(spec.drain),
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": volumes,
    }
    if settings.worker_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.worker_image_pull_secrets]
    if adapters_gate:
        pod_spec["readinessGates"] = [{"conditionType": ADAPTERS_READY_GATE}]
    pod_spec.update(_scheduling(spec.pod))
    template_metadata = _pod_metadata(
        spec.pod,
        {**common_labels(worker), **DISCOVERY_LABELS},
        _scrape_annotations(spec, settings, wi.SYSTEM_PORT),
    )
    deployment = _deployment(
        dw,
        deployment_name(worker),
        spec.replicas,
        selector_labels(worker),
        {"metadata": template_metadata, "spec": pod_spec},
    )
    deployment["spec"]["progressDeadlineSeconds"] = PROGRESS_DEADLINE_SECONDS
    return deployment


def _deployment(
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
        "metadata": _metadata(dw, name, labels),
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


def _service_port(name: str, port: int) -> Manifest:
    """A TCP Service port forwarding to the container port of the same name."""
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


def desired_service(dw: DynamoWorker) -> Manifest:
    """The headless Service on the system and HTTP ports; its EndpointSlices list ready pods
    and carry upstream's discovery labels."""
    worker, _, _ = _identity(dw)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(dw, service_name(worker), DISCOVERY_LABELS),
        "spec": {
            "clusterIP": "None",
            # Not-ready pods stay out of the EndpointSlices (publishNotReadyAddresses is left at
            # its default, false: the API server omits a false value, so setting it would
            # never compare equal to the stored object).
            "selector": selector_labels(worker),
            "ports": [
                _service_port(wi.SYSTEM_PORT_NAME, wi.SYSTEM_PORT),
                _service_port(wi.HTTP_PORT_NAME, wi.HTTP_PORT),
            ],
        },
    }


def desired_pdb(dw: DynamoWorker) -> Manifest:
    """At most one worker pod voluntarily disrupted at a time. Unhealthy pods may always be
    evicted, so a crashing worker never blocks a node drain."""
    worker, _, _ = _identity(dw)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(dw, pdb_name(worker)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(worker)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _service_account(dw: DynamoWorker, name: str, labels: Manifest | None = None) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(dw, name, labels)}


def _role(
    dw: DynamoWorker, name: str, rules: list[Manifest], labels: Manifest | None = None
) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(dw, name, labels),
        "rules": rules,
    }


def _role_binding(dw: DynamoWorker, name: str, labels: Manifest | None = None) -> Manifest:
    """Grants the Role `name` to the ServiceAccount `name`."""
    _, namespace, _ = _identity(dw)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(dw, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }


def desired_service_account(dw: DynamoWorker) -> Manifest:
    """The worker pods' identity."""
    return _service_account(dw, service_account_name(_identity(dw)[0]))


def desired_role(dw: DynamoWorker) -> Manifest:
    """What a worker does with the API: write its own DynamoWorkerMetadata, nothing else.
    (A Role cannot name objects that do not exist yet for `create`, so the rule covers the
    kind in the namespace.)"""
    rule = {"apiGroups": [dwm.GROUP], "resources": [dwm.PLURAL], "verbs": list(WORKER_ROLE_VERBS)}
    return _role(dw, service_account_name(_identity(dw)[0]), [rule])


def desired_role_binding(dw: DynamoWorker) -> Manifest:
    """Grants the Role to the worker ServiceAccount."""
    return _role_binding(dw, service_account_name(_identity(dw)[0]))


def _pod_monitor(
    dw: DynamoWorker, name: str, selector: Manifest, port_name: str, labels: Manifest | None = None
) -> Manifest:
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": _metadata(dw, name, labels),
        "spec": {
            "selector": {"matchLabels": selector},
            "podMetricsEndpoints": [{"port": port_name, "path": wi.METRICS_PATH}],
        },
    }


def desired_pod_monitor(dw: DynamoWorker) -> Manifest:
    """A Prometheus Operator PodMonitor scraping each worker pod's system port."""
    worker, _, _ = _identity(dw)
    return _pod_monitor(dw, pod_monitor_name(worker), selector_labels(worker), wi.SYSTEM_PORT_NAME)


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
    worker, namespace, _ = _identity(dw)
    return f"http://{frontend_name(worker)}.{namespace}.svc:{wi.FRONTEND_PORT}"


def _frontend_env(dw: DynamoWorker, frontend: Frontend) -> list[Manifest]:
    worker, namespace, _ = _identity(dw)
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
    return env + _downward_env()


def _frontend_resources(frontend: Frontend) -> Manifest:
    res = frontend.resources
    out: Manifest = {}
    if res.cpu is not None:
        out.setdefault("requests", {})["cpu"] = _quantity(res.cpu)
    if res.memory is not None:
        out.setdefault("requests", {})["memory"] = _quantity(res.memory)
        out["limits"] = {"memory": _quantity(res.memory)}
    return out


def desired_frontend_deployment(
    dw: DynamoWorker, frontend: Frontend, settings: ReconcileSettings
) -> Manifest:
    """The Deployment of frontend pods (container `main` running upstream's frontend)."""
    worker, _, _ = _identity(dw)
    name = frontend_name(worker)
    env = _frontend_env(dw, frontend)
    env += _user_env(frontend.pod, "spec.frontend.pod", {e["name"] for e in env})
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
            "httpGet": {"path": wi.LIVE_PATH, **probe_port},
            **wi.FRONTEND_LIVENESS,
        },
        "readinessProbe": {
            "httpGet": {"path": wi.HEALTH_PATH, **probe_port},
            **wi.FRONTEND_READINESS,
        },
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": VOLUME_TMP, "mountPath": wi.TMP_PATH}],
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
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [{"name": VOLUME_TMP, "emptyDir": {}}],
        **_scheduling(frontend.pod),
    }
    if settings.worker_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.worker_image_pull_secrets]
    template_metadata = _pod_metadata(
        frontend.pod,
        frontend_labels(worker),
        _scrape_annotations(dw.spec, settings, wi.FRONTEND_PORT),
    )
    return _deployment(
        dw,
        name,
        frontend.replicas,
        frontend_selector_labels(worker),
        {"metadata": template_metadata, "spec": pod_spec},
        FRONTEND_COMPONENT,
    )


def desired_frontend_service(dw: DynamoWorker) -> Manifest:
    """The frontend's ClusterIP Service: the address clients (or an Ingress) use."""
    worker, _, _ = _identity(dw)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(dw, frontend_name(worker), FRONTEND_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": frontend_selector_labels(worker),
            "ports": [_service_port(wi.FRONTEND_PORT_NAME, wi.FRONTEND_PORT)],
        },
    }


def desired_frontend_children(dw: DynamoWorker, settings: ReconcileSettings) -> list[Manifest]:
    """The frontend's children in apply order (none when spec.frontend is unset): its
    identity and read-only discovery permissions, its Service, its Deployment, and a
    PodMonitor on its OpenAI port when the workers get one (spec.metrics)."""
    frontend = dw.spec.frontend
    if frontend is None:
        return []
    worker = _identity(dw)[0]
    name = frontend_name(worker)
    children = [
        _service_account(dw, name, FRONTEND_COMPONENT),
        _role(dw, name, FRONTEND_ROLE_RULES, FRONTEND_COMPONENT),
        _role_binding(dw, name, FRONTEND_COMPONENT),
        desired_frontend_service(dw),
        desired_frontend_deployment(dw, frontend, settings),
    ]
    if wants_pod_monitor(dw.spec, settings) and settings.pod_monitor_crd:
        children.append(
            _pod_monitor(
                dw,
                name,
                frontend_selector_labels(worker),
                wi.FRONTEND_PORT_NAME,
                FRONTEND_COMPONENT,
            )
        )
    return children


def desired_children(
    dw: DynamoWorker, settings: ReconcileSettings, *, adapters_gate: bool = False
) -> list[Manifest]:
    """Every child the worker should have, in apply order: identity and permissions before
    the pods that use them. The PodMonitor only when its CRD exists; the frontend's children
    last (when spec.frontend is set)."""
    children = [
        desired_service_account(dw),
        desired_role(dw),
        desired_role_binding(dw),
        desired_service(dw),
        desired_pdb(dw),
        desired_deployment(dw, settings, adapters_gate=adapters_gate),
    ]
    if wants_pod_monitor(dw.spec, settings) and settings.pod_monitor_crd:
        children.append(desired_pod_monitor(dw))
    return children + desired_frontend_children(dw, settings)
