"""Pure builders: a DynamoWorker (and the operator's settings) in, its children's manifests out.

Each `desired_*` returns the complete manifest the operator server-side-applies: only the
fields it owns, no status, no server-filled defaults. No I/O here; unit tests compare the
output with golden files. The frontend's children are built by `frontend`, from the shared
pieces in `manifests`.
"""

from __future__ import annotations

from dynamo_operator.api import metadata as dwm
from dynamo_operator.api.dynamoworker import (
    DECODE,
    PREFILL,
    DynamoWorker,
    DynamoWorkerSpec,
    WorkerRole,
)
from dynamo_operator.pods import routes
from dynamo_operator.reconcile.dynamoworker import disaggregation
from dynamo_operator.reconcile.dynamoworker import interface as wi
from dynamo_operator.reconcile.dynamoworker import manifests as m
from dynamo_operator.reconcile.dynamoworker.activator import (
    desired_activator_children,
    wants_activator,
)
from dynamo_operator.reconcile.dynamoworker.frontend import desired_frontend_children
from dynamo_operator.reconcile.dynamoworker.interface import Env
from dynamo_operator.reconcile.dynamoworker.labels import (
    ADAPTERS_READY_GATE,
    DISCOVERY_LABELS,
    OPERATOR_LABEL,
    activator_name,
    activator_selector_labels,
    deployment_name,
    frontend_selector_labels,
    model_cache_claim_name,
    network_policy_name,
    pdb_name,
    pod_monitor_name,
    selector_labels,
    service_account_name,
    service_name,
    worker_pod_labels,
)
from dynamo_operator.reconcile.dynamoworker.manifests import Manifest
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError

GPU_RESOURCE = "nvidia.com/gpu"
POD_MONITOR_CRD = "podmonitors.monitoring.coreos.com"
# A Deployment reports ProgressDeadlineExceeded after this long without progress. Pods may
# legitimately take the whole startup-probe budget to load a model, so the deadline covers
# that budget plus ten minutes for scheduling and image pulls.
PROGRESS_DEADLINE_SECONDS = wi.STARTUP_BUDGET_SECONDS + 600
WORKER_ROLE_VERBS = ["get", "create", "patch", "update", "delete"]
ADMIN_REVIEW_RULE: Manifest = {
    "apiGroups": ["authorization.k8s.io"],
    "resources": ["localsubjectaccessreviews"],
    "verbs": ["create"],
}
VOLUME_SHM, VOLUME_CACHE, VOLUME_LORA = "shm", "cache", "lora-cache"
VOLUME_MODEL_CACHE = "model-cache"


def _worker_env(dw: DynamoWorker, role: WorkerRole | None) -> list[Manifest]:
    worker, namespace, _ = m.identity(dw)
    spec = dw.spec
    drain = spec.drain
    plain: list[tuple[str, str]] = [
        (Env.NAMESPACE, wi.dynamo_namespace(namespace, worker)),
        (Env.COMPONENT, wi.COMPONENT),
        (Env.SYSTEM_PORT, str(routes.SYSTEM_PORT)),
        (Env.HTTP_PORT, str(wi.HTTP_PORT)),
        (Env.DISCOVERY_BACKEND, wi.DISCOVERY_BACKEND),
        (Env.REQUEST_PLANE, wi.REQUEST_PLANE),
        (Env.LORA_ENABLED, "true" if spec.lora.enabled else "false"),
        (Env.SYSTEM_ADMIN_AUTH, wi.SYSTEM_ADMIN_AUTH),
        (Env.SYSTEM_ADMIN_AUTH_WORKER, worker),
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
    plain += [
        (Env.HOME, wi.TMP_PATH),
        (Env.HF_HOME, wi.HF_HOME_PATH),
        (Env.MODEL_CACHE, wi.MODEL_CACHE_PATH),
    ]
    if spec.model.cache is not None:
        # Load from the filled cache or fail naming it: never a download per pod.
        plain.append((Env.MODEL_CACHE_REQUIRED, "true"))
    env: list[Manifest] = [{"name": str(name), "value": value} for name, value in plain]
    env += m.downward_env()
    env += m.credential_env(spec)
    if role is not None:
        env += disaggregation.kv_transfer_env()
    return env


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _resources(spec: DynamoWorkerSpec) -> Manifest:
    res = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu is not None:
        requests["cpu"] = m.quantity(res.cpu)
    if res.memory is not None:
        requests["memory"] = limits["memory"] = m.quantity(res.memory)
    if res.gpus_per_pod > 0:
        # Extended resources must be requested and limited alike.
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(res.gpus_per_pod)
    out: Manifest = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(worker: str, spec: DynamoWorkerSpec) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = [
        {
            "name": VOLUME_SHM,
            "emptyDir": {
                "medium": "Memory",
                "sizeLimit": m.quantity(spec.resources.shared_memory_size),
            },
        },
        {"name": m.VOLUME_TMP, "emptyDir": {}},
        {"name": VOLUME_CACHE, "emptyDir": {}},
    ]
    mounts: list[Manifest] = [
        {"name": VOLUME_SHM, "mountPath": wi.SHM_PATH},
        {"name": m.VOLUME_TMP, "mountPath": wi.TMP_PATH},
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
                empty_dir["sizeLimit"] = m.quantity(size_limit)
            source = {"emptyDir": empty_dir}
        volumes.append({"name": VOLUME_LORA, **source})
        mounts.append({"name": VOLUME_LORA, "mountPath": wi.LORA_PATH})
    model_cache = spec.model.cache
    if model_cache is not None:
        # Read-only: the fill Job is the one writer; the pods only load their key's directory.
        claim = model_cache_claim_name(worker, model_cache.claim_name)
        volumes.append(
            {
                "name": VOLUME_MODEL_CACHE,
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
            }
        )
        mounts.append(
            {"name": VOLUME_MODEL_CACHE, "mountPath": wi.MODEL_CACHE_PATH, "readOnly": True}
        )
    return volumes, mounts


def _probe(path: str, timings: dict[str, int]) -> Manifest:
    return {"httpGet": {"path": path, "port": routes.SYSTEM_PORT_NAME}, **timings}


def worker_image(dw: DynamoWorker, settings: ReconcileSettings) -> str:
    """spec.image, else the operator's default image for the engine: the vLLM image for the
    vLLM engine (the reference image has no vLLM), the worker image for the others."""
    if dw.spec.image:
        return dw.spec.image
    if dw.spec.engine.is_vllm:
        image, what, flag = settings.vllm_worker_image, "vLLM worker image", "--vllm-worker-image"
    else:
        image, what, flag = settings.worker_image, "worker image", "--worker-image"
    if not image:
        raise SpecError(
            f"spec.image is unset and the operator has no default {what}; set spec.image "
            f"or run the operator with {flag}"
        )
    return image


def desired_deployment(
    dw: DynamoWorker,
    settings: ReconcileSettings,
    *,
    adapters_gate: bool = False,
    role: WorkerRole | None = None,
    hold_last_pod: bool = False,
) -> Manifest:
    """The Deployment of worker pods (container `main` running `dynamo-worker`), of the pods
    of `role` for a disaggregated worker; with the LoRA-adapters readiness gate when
    `adapters_gate` (see `adapter_gate`); with one pod whatever spec.replicas says when
    `hold_last_pod` (the hand-over to zero, see `handover`)."""
    worker, _, _ = m.identity(dw)
    spec = dw.spec.for_role(role)
    env = _worker_env(dw, role)
    # The env clashes are reported at the block the pods took (spec.prefill.pod, else spec.pod).
    prefill = dw.spec.prefill if role == PREFILL else None
    pod_field = (
        "spec.prefill.pod" if prefill is not None and prefill.pod is not None else "spec.pod"
    )
    env += m.user_env(spec.pod, pod_field, {e["name"] for e in env})
    volumes, mounts = _volumes(worker, spec)
    container: Manifest = {
        "name": wi.CONTAINER_NAME,
        "image": worker_image(dw, settings),
        "command": list(wi.COMMAND),
        "args": wi.worker_args(spec, role),
        "ports": m.serving_ports(),
        "env": env,
        "resources": _resources(spec),
        "startupProbe": _probe(routes.LIVE_PATH, wi.STARTUP),
        "livenessProbe": _probe(routes.LIVE_PATH, wi.LIVENESS),
        "readinessProbe": _probe(routes.HEALTH_PATH, wi.READINESS),
        "securityContext": dict(m.CONTAINER_SECURITY_CONTEXT),
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
        "securityContext": dict(m.POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": volumes,
    }
    if settings.worker_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.worker_image_pull_secrets]
    if adapters_gate:
        pod_spec["readinessGates"] = [{"conditionType": ADAPTERS_READY_GATE}]
    pod_spec.update(m.scheduling(spec.pod))
    template_metadata = m.pod_metadata(
        spec.pod,
        {**worker_pod_labels(worker, role), **DISCOVERY_LABELS},
        m.scrape_annotations(spec, settings, routes.SYSTEM_PORT),
    )
    deployment = m.deployment(
        dw,
        deployment_name(worker, role),
        1 if hold_last_pod else spec.replicas,
        selector_labels(worker, role),
        {"metadata": template_metadata, "spec": pod_spec},
    )
    deployment["spec"]["progressDeadlineSeconds"] = PROGRESS_DEADLINE_SECONDS
    return deployment


def desired_service(dw: DynamoWorker, role: WorkerRole | None = None) -> Manifest:
    """The headless Service on the system and HTTP ports (of the pods of `role`); its
    EndpointSlices list ready pods and carry upstream's discovery labels."""
    worker, _, _ = m.identity(dw)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": m.object_metadata(dw, service_name(worker, role), DISCOVERY_LABELS),
        "spec": {
            "clusterIP": "None",
            # Not-ready pods stay out of the EndpointSlices (publishNotReadyAddresses is left at
            # its default, false: the API server omits a false value, so setting it would
            # never compare equal to the stored object).
            "selector": selector_labels(worker, role),
            "ports": [
                m.service_port(routes.SYSTEM_PORT_NAME, routes.SYSTEM_PORT),
                m.service_port(wi.HTTP_PORT_NAME, wi.HTTP_PORT),
            ],
        },
    }


def desired_pdb(dw: DynamoWorker, role: WorkerRole | None = None) -> Manifest:
    """At most one worker pod (of `role`) voluntarily disrupted at a time. Unhealthy pods may
    always be evicted, so a crashing worker never blocks a node drain."""
    worker, _, _ = m.identity(dw)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": m.object_metadata(dw, pdb_name(worker, role)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(worker, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def desired_service_account(dw: DynamoWorker) -> Manifest:
    """The worker pods' identity."""
    return m.service_account(dw, service_account_name(m.identity(dw)[0]))


def desired_role(dw: DynamoWorker) -> Manifest:
    """What a worker does with the API: write its own DynamoWorkerMetadata (a Role cannot
    name objects that do not exist yet for `create`, so the rule covers the kind in the
    namespace), and ask whether a caller of its admin routes may change it, in this
    namespace only (LocalSubjectAccessReview; the TokenReview is the chart's binding)."""
    metadata = {
        "apiGroups": [dwm.GROUP],
        "resources": [dwm.PLURAL],
        "verbs": list(WORKER_ROLE_VERBS),
    }
    return m.role(dw, service_account_name(m.identity(dw)[0]), [metadata, ADMIN_REVIEW_RULE])


def desired_role_binding(dw: DynamoWorker) -> Manifest:
    """Grants the Role to the worker ServiceAccount."""
    return m.role_binding(dw, service_account_name(m.identity(dw)[0]))


def desired_pod_monitor(dw: DynamoWorker, role: WorkerRole | None = None) -> Manifest:
    """A Prometheus Operator PodMonitor scraping each worker pod's (of `role`) system port."""
    worker, _, _ = m.identity(dw)
    return m.pod_monitor(
        dw, pod_monitor_name(worker, role), selector_labels(worker, role), routes.SYSTEM_PORT_NAME
    )


NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _namespace_peer(namespace: str) -> Manifest:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}}


def desired_network_policy(
    dw: DynamoWorker,
    settings: ReconcileSettings,
    *,
    activator: bool = False,
    role: WorkerRole | None = None,
) -> Manifest:
    """Ingress to the worker pods (of `role`, for a disaggregated worker; or, with
    `activator`, to the activator's pod, which stands in for them and so admits the same
    peers): the system port from the operator's pods and
    spec.networkPolicy.systemPortNamespaces; every port from this worker's frontend (when
    spec.frontend is set), the activator or the workers for each other (when the worker may
    scale to zero) and spec.networkPolicy.clientNamespaces (the TCP request plane and
    the event plane listen on ephemeral ports that discovery advertises, so no port list can
    name them); the KV transfer's ports from the other role's pods (with spec.prefill).
    Egress is not limited (model and adapter downloads)."""
    worker, namespace, _ = m.identity(dw)
    policy = dw.spec.network_policy
    operator_namespace: Manifest = (
        {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}}
        if settings.operator_namespace
        else {}
    )
    operator = {
        "namespaceSelector": operator_namespace,
        "podSelector": {"matchLabels": {OPERATOR_LABEL: "true"}},
    }
    clients = [_namespace_peer(n) for n in policy.client_namespaces]
    if wants_activator(dw):
        # The workers admit their activator (it forwards held requests and reads their card
        # files); the activator admits the workers (a forwarded request's answer calls the
        # activator home, on a port of its own).
        peer = selector_labels(worker) if activator else activator_selector_labels(worker)
        clients.insert(0, {**_namespace_peer(namespace), "podSelector": {"matchLabels": peer}})
    if dw.spec.frontend is not None:
        frontend_pods = {"matchLabels": frontend_selector_labels(worker)}
        clients.insert(0, {**_namespace_peer(namespace), "podSelector": frontend_pods})
    system_port = {"port": routes.SYSTEM_PORT_NAME, "protocol": "TCP"}
    ingress: list[Manifest] = [
        {
            "from": [operator, *map(_namespace_peer, policy.system_port_namespaces)],
            "ports": [system_port],
        }
    ]
    if clients:  # (a rule with no peers would admit everyone)
        ingress.append({"from": clients})
    if role is not None:
        other = DECODE if role == PREFILL else PREFILL
        # The KV transfer's ports, from the other role's pods only.
        other_role: Manifest = {"matchLabels": selector_labels(worker, other)}
        kv_peer = {**_namespace_peer(namespace), "podSelector": other_role}
        ingress.append({"from": [kv_peer], "ports": disaggregation.kv_transfer_ports(dw.spec)})
    pods = activator_selector_labels(worker) if activator else selector_labels(worker, role)
    name = activator_name(worker) if activator else network_policy_name(worker, role)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": m.object_metadata(dw, name),
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def desired_children(
    dw: DynamoWorker,
    settings: ReconcileSettings,
    *,
    adapters_gate: bool = False,
    hold_deployment: bool = False,
    hold_last_pod: bool = False,
) -> list[Manifest]:
    """Every child the worker should have, in apply order: identity and permissions before
    the pods that use them, the NetworkPolicy before the pods it isolates (unless
    spec.networkPolicy.enabled is false). The PodMonitor only when its CRD exists; the
    activator's children when the worker may scale to zero; the frontend's children last
    (when spec.frontend is set). With spec.prefill, the Service, PDB, NetworkPolicy,
    Deployment and PodMonitor are made for each role; both roles share the identity.
    `hold_deployment` leaves the worker Deployments out, neither made nor changed (while the
    model cache fills for a new source); `hold_last_pod` keeps one worker pod while the
    activator takes over at zero (see `handover`)."""
    roles = disaggregation.roles(dw.spec)
    children = [
        desired_service_account(dw),
        desired_role(dw),
        desired_role_binding(dw),
        *(desired_service(dw, role) for role in roles),
        *(desired_pdb(dw, role) for role in roles),
    ]
    if dw.spec.network_policy.enabled:  # before the pods, so they start isolated
        children += [desired_network_policy(dw, settings, role=role) for role in roles]
        if wants_activator(dw):
            children.append(desired_network_policy(dw, settings, activator=True))
    if not hold_deployment:
        children += [
            desired_deployment(
                dw, settings, adapters_gate=adapters_gate, role=role, hold_last_pod=hold_last_pod
            )
            for role in roles
        ]
    if m.wants_pod_monitor(dw.spec, settings) and settings.pod_monitor_crd:
        children += [desired_pod_monitor(dw, role) for role in roles]
    children += desired_activator_children(dw, settings)
    return children + desired_frontend_children(dw, settings)
