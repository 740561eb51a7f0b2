"""Pure builders: a DynamoWorker (and the operator's settings) in, the children's manifests out.

Each `desired_*` returns the complete manifest the operator server-side-applies: only the
fields it owns, no status, no server-filled defaults. No I/O here; unit tests compare the
output with golden files.
"""

from __future__ import annotations

from typing import Any

from dynamo_operator.api import metadata as dwm
from dynamo_operator.api.dynamoworker import DynamoWorker, DynamoWorkerSpec
from dynamo_operator.reconcile import interface as wi
from dynamo_operator.reconcile.errors import SpecError
from dynamo_operator.reconcile.interface import Env
from dynamo_operator.reconcile.labels import (
    DISCOVERY_LABELS,
    common_labels,
    deployment_name,
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


def _scrape_annotations(spec: DynamoWorkerSpec, settings: ReconcileSettings) -> dict[str, str]:
    """prometheus.io annotations, the fallback for scrapers configured by annotation."""
    if spec.metrics.pod_monitor != "Auto" or settings.pod_monitor_crd:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(wi.SYSTEM_PORT),
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
    env += [
        {"name": str(name), "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in wi.DOWNWARD_ENV.items()
    ]
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


def _user_env(spec: DynamoWorkerSpec, reserved: set[str]) -> list[Manifest]:
    if spec.pod is None:
        return []
    clashes = sorted(e.name for e in spec.pod.env if e.name in reserved)
    if clashes:
        raise SpecError(
            f"spec.pod.env sets {', '.join(clashes)}, which the operator sets from the spec; "
            "remove them (use the matching spec field instead)"
        )
    return [e.to_dict() for e in spec.pod.env]


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


def desired_deployment(dw: DynamoWorker, settings: ReconcileSettings) -> Manifest:
    """The Deployment of worker pods (container `main` running `dynamo-worker`)."""
    worker, _, _ = _identity(dw)
    spec = dw.spec
    env = _worker_env(dw)
    env += _user_env(spec, {e["name"] for e in env})
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
    pod_labels = dict(spec.pod.labels) if spec.pod else {}
    pod_annotations = dict(spec.pod.annotations) if spec.pod else {}
    pod_labels.update({**common_labels(worker), **DISCOVERY_LABELS})
    pod_annotations.update(_scrape_annotations(spec, settings))
    if spec.pod is not None:
        overrides = spec.pod
        if overrides.node_selector:
            pod_spec["nodeSelector"] = dict(overrides.node_selector)
        if overrides.tolerations:
            pod_spec["tolerations"] = [t.to_dict() for t in overrides.tolerations]
        if overrides.affinity:
            pod_spec["affinity"] = overrides.affinity
        if overrides.priority_class_name:
            pod_spec["priorityClassName"] = overrides.priority_class_name
    template_metadata: Manifest = {"labels": pod_labels}
    if pod_annotations:
        template_metadata["annotations"] = pod_annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(dw, deployment_name(worker)),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(worker)},
            # Surge one pod and never go below the ready count: a model server takes long to
            # load, so a rollout should not drop serving capacity while the new pod loads.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "template": {"metadata": template_metadata, "spec": pod_spec},
        },
    }


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
                {
                    "name": wi.SYSTEM_PORT_NAME,
                    "port": wi.SYSTEM_PORT,
                    "targetPort": wi.SYSTEM_PORT_NAME,
                    "protocol": "TCP",
                },
                {
                    "name": wi.HTTP_PORT_NAME,
                    "port": wi.HTTP_PORT,
                    "targetPort": wi.HTTP_PORT_NAME,
                    "protocol": "TCP",
                },
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


def desired_service_account(dw: DynamoWorker) -> Manifest:
    """The worker pods' identity."""
    worker, _, _ = _identity(dw)
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(dw, service_account_name(worker)),
    }


def desired_role(dw: DynamoWorker) -> Manifest:
    """What a worker does with the API: write its own DynamoWorkerMetadata, nothing else.
    (A Role cannot name objects that do not exist yet for `create`, so the rule covers the
    kind in the namespace.)"""
    worker, _, _ = _identity(dw)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(dw, service_account_name(worker)),
        "rules": [
            {
                "apiGroups": [dwm.GROUP],
                "resources": [dwm.PLURAL],
                "verbs": list(WORKER_ROLE_VERBS),
            }
        ],
    }


def desired_role_binding(dw: DynamoWorker) -> Manifest:
    """Grants the Role to the worker ServiceAccount."""
    worker, namespace, _ = _identity(dw)
    name = service_account_name(worker)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(dw, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }


def desired_pod_monitor(dw: DynamoWorker) -> Manifest:
    """A Prometheus Operator PodMonitor scraping each pod's system port."""
    worker, _, _ = _identity(dw)
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": _metadata(dw, pod_monitor_name(worker)),
        "spec": {
            "selector": {"matchLabels": selector_labels(worker)},
            "podMetricsEndpoints": [{"port": wi.SYSTEM_PORT_NAME, "path": wi.METRICS_PATH}],
        },
    }


def desired_children(dw: DynamoWorker, settings: ReconcileSettings) -> list[Manifest]:
    """Every child the worker should have, in apply order: identity and permissions before
    the pods that use them. The PodMonitor only when its CRD exists."""
    children = [
        desired_service_account(dw),
        desired_role(dw),
        desired_role_binding(dw),
        desired_service(dw),
        desired_pdb(dw),
        desired_deployment(dw, settings),
    ]
    if wants_pod_monitor(dw.spec, settings) and settings.pod_monitor_crd:
        children.append(desired_pod_monitor(dw))
    return children
