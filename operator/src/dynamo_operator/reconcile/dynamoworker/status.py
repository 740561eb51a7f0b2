"""Computing DynamoWorker.status from what was observed (pure).

Conditions, per the Kubernetes API conventions:
- `Ready`: every desired pod is ready, and so is every frontend pod when spec.frontend is set
  and every prefill pod, on the current spec, when spec.prefill is set (True with
  `AllReplicasReady` or `ScaledToZero`).
- `Progressing`: a worker Deployment (the prefill one too) is being created, rolled or scaled,
  or its last pod serves until the activator takes over at zero (`HandingOverToActivator`);
  False with `RolloutComplete` once every pod runs the current spec and is ready.
- `Degraded`: something needs a person: a child the API server refused, pods that cannot be
  scheduled, pull their image, start, or keep running, a stalled rollout, KV-cache transfers
  failing between the roles, taints a pod would not take, a PodMonitor asked for without its
  CRD. False with `AsExpected` otherwise.

Messages say what is wrong and which field or command fixes it. The same observation always
yields the same status (sorted lists, no timestamps but the conditions' transition times, which
`merge_conditions` keeps), so a converged worker's status is never rewritten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dynamo_operator.api.autoscaling import AutoscalingStatus
from dynamo_operator.api.common import ConditionType
from dynamo_operator.api.conditions import WantedCondition, apply_conditions, name_list
from dynamo_operator.api.dynamoworker import (
    DECODE,
    MAX_STATUS_PODS,
    PREFILL,
    DynamoWorker,
    DynamoWorkerStatus,
    FrontendStatus,
    ModelCacheStatus,
    PrefillStatus,
    PublishedTokenBudget,
    WorkerPodStatus,
    WorkerRole,
)
from dynamo_operator.api.kv_transfer import FAILURE_WINDOW_SECONDS, KvTransferStatus
from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.reconcile.dynamoworker.frontend import frontend_url
from dynamo_operator.reconcile.dynamoworker.handover import HAND_OVER_TIMEOUT_SECONDS, HandOver
from dynamo_operator.reconcile.dynamoworker.labels import (
    FRONTEND_LABEL,
    deployment_name,
    selector_string,
)
from dynamo_operator.reconcile.dynamoworker.model_cache import CachePhase, CacheState
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodProblem, PodSummary


@dataclass(frozen=True)
class WorkerObservation:
    """Everything status is computed from.

    `deployment` is the live worker Deployment, `prefill_deployment` the prefill pods' (with
    spec.prefill), `frontend_deployment` the frontend's (None: absent). `pods` are the
    worker's pods (both roles');
    `metadata` their DynamoWorkerMetadata by pod name. `child_errors` are the API server's
    refusals of children (one line each, naming the child). `taint_failures` maps a pod name
    to why pushing spec.modelTaints to it failed. `pod_monitor_unavailable` is set when a
    PodMonitor is asked for and its CRD is missing. `spec_error` is set when the spec cannot
    be turned into children (its message names the field). `model_cache` is the fill of the
    current source when spec.model.cache is set. `autoscaling` is the autoscaler's view
    (status.autoscaling) when spec.autoscaling is set. `kv_transfer` is the KV-transfer
    monitor's view per role when spec.prefill is set. `hand_over` is where the hand-over to
    the activator stands when spec.replicas is 0.
    """

    now: datetime
    deployment: Mapping[str, Any] | None = None
    prefill_deployment: Mapping[str, Any] | None = None
    frontend_deployment: Mapping[str, Any] | None = None
    pods: Sequence[PodSummary] = ()
    metadata: Mapping[str, DynamoWorkerMetadata] = field(default_factory=dict)
    child_errors: Sequence[str] = ()
    taint_failures: Mapping[str, str] = field(default_factory=dict)
    pod_monitor_unavailable: bool = False
    spec_error: str | None = None
    model_cache: CacheState | None = None
    autoscaling: AutoscalingStatus | None = None
    kv_transfer: Mapping[WorkerRole, KvTransferStatus] | None = None
    hand_over: HandOver = HandOver.NONE


def _pod_status(pod: PodSummary, record: DynamoWorkerMetadata | None) -> WorkerPodStatus:
    if record is None:
        return WorkerPodStatus(name=pod.name, role=pod.role, ready=pod.ready)
    budget = record.token_budget
    config = record.runtime_config
    return WorkerPodStatus(
        name=pod.name,
        role=pod.role,
        ready=pod.ready,
        token_budget=(
            PublishedTokenBudget(
                combined_limit=budget.combined_limit,
                reject_prompt_overflow=budget.reject_prompt_overflow,
                reject_total_overflow=budget.reject_total_overflow,
            )
            if budget is not None
            else None
        ),
        taints=config.caller_taints if config is not None else [],
        loaded_adapters=record.loaded_adapters,
        dp_ranks=record.dp_ranks,
    )


def _deployment_counts(deployment: Mapping[str, Any] | None) -> tuple[int, int, int, bool]:
    """(pods, ready, updated, controller has seen the current Deployment spec)."""
    if deployment is None:
        return 0, 0, 0, False
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation") or 0
    seen = int(status.get("observedGeneration") or 0) >= int(generation)
    return (
        int(status.get("replicas") or 0),
        int(status.get("readyReplicas") or 0),
        int(status.get("updatedReplicas") or 0),
        seen,
    )


def _deployment_condition(deployment: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any]:
    if deployment is None:
        return {}
    for condition in (deployment.get("status") or {}).get("conditions") or []:
        if condition.get("type") == type_:
            return dict(condition)
    return {}


def _frontend_waiting(desired: int | None, observed: WorkerObservation) -> str | None:
    """Why the frontend (spec.frontend, `desired` pods) is not serving yet; None when it is
    or when there is none."""
    if desired is None or desired == 0:
        return None
    if observed.frontend_deployment is None:
        return "the frontend Deployment does not exist yet"
    _, ready, _, _ = _deployment_counts(observed.frontend_deployment)
    if ready < desired:
        return f"{ready} of {desired} frontend pods are ready"
    return None


def _prefill_waiting(desired: int | None, observed: WorkerObservation) -> str | None:
    """Why the prefill pods (spec.prefill, `desired` pods) are not all serving the current
    spec yet: prefill and decode pods on different specs (another model, say) could not hand
    the KV cache over. None when they are, or when there are none."""
    if desired is None or desired == 0:
        return None
    if observed.prefill_deployment is None:
        return "the prefill Deployment does not exist yet"
    _, ready, updated, seen = _deployment_counts(observed.prefill_deployment)
    if not seen or ready < desired or updated < desired:
        return f"{ready} of {desired} prefill pods are ready, {updated} run the current spec"
    return None


def _ready(
    desired: int,
    ready: int,
    frontend_desired: int | None,
    prefill_desired: int | None,
    observed: WorkerObservation,
) -> WantedCondition:
    t = ConditionType.READY
    if observed.spec_error is not None:
        return WantedCondition(t, "False", "InvalidSpec", observed.spec_error)
    cache = observed.model_cache
    if observed.deployment is None and cache is not None and not cache.ready:
        return WantedCondition(
            t,
            "False",
            "WaitingForModelCache",
            "the pods start once the model is in the cache; see the ModelCached condition",
        )
    if observed.deployment is None:
        if observed.child_errors:
            return WantedCondition(
                t,
                "False",
                "ApplyFailed",
                "the worker Deployment could not be created; see the Degraded condition",
            )
        return WantedCondition(
            t,
            "False",
            "DeploymentMissing",
            "the worker Deployment does not exist yet; the operator is creating it",
        )
    if desired == 0:
        message = "spec.replicas is 0: no worker pods run; scale up to serve"
        if observed.autoscaling is not None:
            message = (
                "the autoscaler scaled to zero: requests are held by the activator while a "
                "pod starts"
            )
        return WantedCondition(t, "True", "ScaledToZero", message)
    if ready >= desired:
        prefill = _prefill_waiting(prefill_desired, observed)
        if prefill is not None:
            return WantedCondition(t, "False", "PrefillNotReady", f"{prefill}; see status.prefill")
        frontend = _frontend_waiting(frontend_desired, observed)
        if frontend is not None:
            return WantedCondition(
                t, "False", "WaitingForFrontend", f"{frontend}; see status.frontend"
            )
        return WantedCondition(
            t, "True", "AllReplicasReady", f"{ready} of {desired} pods are ready"
        )
    if any(p.problem for p in observed.pods):
        hint = "; see the Degraded condition"
    elif any(p.gated and p.containers_ready and not p.ready for p in observed.pods):
        hint = (
            "; pods wait for the LoRAAdapters with requiredForReadiness to load "
            "(see `kubectl get lora`)"
        )
    else:
        hint = "; pods load the model before they report ready"
    return WantedCondition(
        t, "False", "WaitingForPods", f"{ready} of {desired} pods are ready{hint}"
    )


def _progressing(
    worker: str,
    generation: int,
    desired: int,
    prefill_desired: int | None,
    observed: WorkerObservation,
) -> WantedCondition:
    t = ConditionType.PROGRESSING
    if observed.spec_error is not None:
        return WantedCondition(
            t, "False", "InvalidSpec", "nothing is rolled out until the spec is fixed"
        )
    cache = observed.model_cache
    if cache is not None and cache.phase is CachePhase.FILLING:
        return WantedCondition(t, "True", "FillingModelCache", cache.message)
    if observed.hand_over is HandOver.WAITING:
        return WantedCondition(
            t,
            "True",
            "HandingOverToActivator",
            "spec.replicas is 0: the last pod serves until the activator stands in (at most "
            f"{HAND_OVER_TIMEOUT_SECONDS:g} s)",
        )
    rollout = _rollout(deployment_name(worker), "worker", generation, desired, observed.deployment)
    if prefill_desired is None or rollout.reason != "RolloutComplete":
        return rollout
    prefill = _rollout(
        deployment_name(worker, PREFILL),
        PREFILL,
        generation,
        prefill_desired,
        observed.prefill_deployment,
    )
    return rollout if prefill.reason == "RolloutComplete" else prefill


def _rollout(
    name: str, what: str, generation: int, desired: int, deployment: Mapping[str, Any] | None
) -> WantedCondition:
    """Where the rollout of the Deployment `name` (of the `what` pods: worker or prefill)
    stands, as the Progressing condition."""
    t = ConditionType.PROGRESSING
    pods = "pods" if what == "worker" else f"{what} pods"
    if deployment is None:
        return WantedCondition(t, "True", "Creating", f"creating the {what} Deployment")
    total, ready, updated, seen = _deployment_counts(deployment)
    stalled = _deployment_condition(deployment, "Progressing")
    if stalled.get("reason") == "ProgressDeadlineExceeded":
        return WantedCondition(
            t,
            "False",
            "ProgressDeadlineExceeded",
            f"the rollout of Deployment "
            f"{name} made no progress before its deadline; see the Degraded condition",
        )
    if not seen:
        return WantedCondition(
            t,
            "True",
            "RollingOut",
            f"generation {generation} of the spec was applied; "
            f"waiting for the Deployment controller to start the rollout",
        )
    if updated < desired:
        return WantedCondition(
            t,
            "True",
            "RollingOut",
            f"{updated} of {desired} {pods} run generation "
            f"{generation} of the spec ({total} {pods} in all)",
        )
    if total > desired:
        return WantedCondition(
            t,
            "True",
            "ScalingDown",
            f"{total - desired} surplus or outdated {pods} are draining and shutting down",
        )
    if ready < desired:
        return WantedCondition(
            t, "True", "ScalingUp", f"{ready} of {desired} {pods} are ready; the rest are starting"
        )
    return WantedCondition(
        t,
        "False",
        "RolloutComplete",
        f"all {desired} {pods} run generation {generation} of the spec and are ready",
    )


_PROBLEM_REASONS: dict[PodProblem, tuple[str, str]] = {
    PodProblem.UNSCHEDULABLE: (
        "PodsUnschedulable",
        "cannot be scheduled ({detail}); lower spec.resources (gpusPerPod, cpu, memory), relax "
        "spec.pod.nodeSelector, tolerations or affinity, or add nodes",
    ),
    PodProblem.IMAGE_PULL: (
        "ImagePullFailed",
        "cannot pull the worker image ({detail}); check spec.image and the registry access "
        "of the namespace",
    ),
    PodProblem.CONFIG: (
        "PodConfigError",
        "cannot start the container ({detail}); create the Secret or ConfigMap it names "
        "(spec.credentials, spec.pod.env) or fix the reference",
    ),
    PodProblem.CRASH_LOOP: (
        "CrashLooping",
        "keeps crashing ({detail}); read its log with `kubectl logs <pod> -c main --previous`",
    ),
    PodProblem.OOM_KILLED: (
        "OOMKilled",
        "ran out of memory; raise spec.resources.memory (and check "
        "spec.resources.sharedMemorySize, which counts against it)",
    ),
}
# When pods have different problems, report the one listed first.
_PROBLEM_ORDER = list(_PROBLEM_REASONS)


# What a failing worker Deployment (the `what`: "" or "prefill ") means, by the reason
# `_deployment_failure` gives.
_DEPLOYMENT_FAILURES = {
    "ReplicaFailure": "the {what}Deployment cannot create pods: {detail}",
    "ProgressDeadlineExceeded": "the {what}rollout stalled: {detail}; check the pods' events",
}


def _deployment_failure(deployment: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(reason, the Deployment's message) when it cannot create pods (`ReplicaFailure`) or its
    rollout stalled (`ProgressDeadlineExceeded`), else None."""
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if failure.get("status") == "True":
        return "ReplicaFailure", str(failure.get("message", ""))
    progress = _deployment_condition(deployment, "Progressing")
    if progress.get("reason") == "ProgressDeadlineExceeded":
        return "ProgressDeadlineExceeded", str(progress.get("message", ""))
    return None


def _frontend_trouble(deployment: Mapping[str, Any] | None) -> str | None:
    """Why the frontend Deployment cannot make or keep its pods, if it says so."""
    failing = _deployment_failure(deployment)
    if failing is None:
        return None
    name = ((deployment or {}).get("metadata") or {}).get("name", "")
    return (
        f"the frontend Deployment {name} is failing ({failing[1]}); check spec.frontend.image "
        f"and command, and `kubectl logs -l {FRONTEND_LABEL}={name.removesuffix('-frontend')}`"
    )


def _kv_transfer_trouble(view: Mapping[WorkerRole, KvTransferStatus] | None) -> str | None:
    """What fails in the KV-cache hand-over between the roles, if a role is Failing."""
    failing = {role: s for role, s in (view or {}).items() if s.health == "Failing"}
    if not failing:
        return None
    decode, prefill = failing.get(DECODE), failing.get(PREFILL)
    seen = []
    if decode is not None:
        seen.append(f"decode pods count {decode.failed_transfers} failed transfers")
    if prefill is not None:
        seen.append(
            f"prefill pods count {prefill.failed_transfers} failed transfers and "
            f"{prefill.expired_requests} requests whose blocks expired unpulled"
        )
    return (
        f"KV-cache transfers between the roles failed in the last {FAILURE_WINDOW_SECONDS} s: "
        f"{'; '.join(seen)}; see status.kvTransfer and status.prefill.kvTransfer, and check "
        "that the NIXL side-channel and UCX ports are open between the roles' pods"
    )


def _degraded(observed: WorkerObservation, pods: Sequence[PodSummary]) -> WantedCondition:
    t = ConditionType.DEGRADED
    if observed.spec_error is not None:
        return WantedCondition(t, "True", "InvalidSpec", observed.spec_error)
    if observed.child_errors:
        return WantedCondition(t, "True", "ApplyFailed", "; ".join(observed.child_errors))
    cache = observed.model_cache
    if cache is not None and cache.phase in (CachePhase.FILL_FAILED, CachePhase.VOLUME_UNAVAILABLE):
        return WantedCondition(t, "True", cache.phase.value, cache.message)
    for deployment, what in ((observed.deployment, ""), (observed.prefill_deployment, "prefill ")):
        failing = _deployment_failure(deployment)
        if failing is not None:
            reason, detail = failing
            message = _DEPLOYMENT_FAILURES[reason].format(what=what, detail=detail)
            return WantedCondition(t, "True", reason, message)
    troubled = sorted(
        (_PROBLEM_ORDER.index(p.problem), p.name, p.problem, p.problem_detail)
        for p in pods
        if p.problem is not None
    )
    if troubled:
        _, _, problem, detail = troubled[0]
        reason, template = _PROBLEM_REASONS[problem]
        same = [pod for _, pod, other, _ in troubled if other == problem]
        subject = f"pod {same[0]}" if len(same) == 1 else f"pods {name_list(same)}"
        return WantedCondition(t, "True", reason, f"{subject} {template.format(detail=detail)}")
    frontend_trouble = _frontend_trouble(observed.frontend_deployment)
    if frontend_trouble is not None:
        return WantedCondition(t, "True", "FrontendFailing", frontend_trouble)
    kv_trouble = _kv_transfer_trouble(observed.kv_transfer)
    if kv_trouble is not None:
        return WantedCondition(t, "True", "KvTransferFailing", kv_trouble)
    if observed.taint_failures:
        names = sorted(observed.taint_failures)
        return WantedCondition(
            t,
            "True",
            "TaintUpdateFailed",
            f"spec.modelTaints could not be applied to "
            f"{name_list(names)}: {observed.taint_failures[names[0]]}; the operator "
            "keeps retrying",
        )
    if observed.pod_monitor_unavailable:
        return WantedCondition(
            t,
            "True",
            "PodMonitorUnavailable",
            "spec.metrics.podMonitor is Enabled "
            "but the PodMonitor CRD (monitoring.coreos.com/v1) is not installed; "
            "install the Prometheus Operator or set podMonitor to Auto",
        )
    return WantedCondition(t, "False", "AsExpected", "no problems observed")


def compute_status(dw: DynamoWorker, observed: WorkerObservation) -> dict[str, Any]:
    """The status the DynamoWorker should have, as the API server stores it (camelCase)."""
    name = dw.metadata.name or ""
    generation = dw.metadata.generation or 0
    desired = dw.spec.replicas
    frontend = dw.spec.frontend
    prefill = dw.spec.prefill
    prefill_desired = prefill.replicas if prefill else None
    total, ready, updated, _ = _deployment_counts(observed.deployment)
    live = [p for p in observed.pods if not p.terminating]
    pods = sorted(live, key=lambda p: p.name)[:MAX_STATUS_PODS]
    wanted = [
        _ready(desired, ready, frontend.replicas if frontend else None, prefill_desired, observed),
        _progressing(name, generation, desired, prefill_desired, observed),
        _degraded(observed, pods),
    ]
    cache = observed.model_cache
    if cache is not None:
        wanted.append(
            WantedCondition(
                ConditionType.MODEL_CACHED,
                "True" if cache.ready else "False",
                cache.phase.value,
                cache.message,
            )
        )
    existing = dw.status.conditions if dw.status is not None else []
    if cache is None:  # no cache (any more): its condition would only be stale
        existing = [c for c in existing if c.type != ConditionType.MODEL_CACHED]
    conditions = apply_conditions(existing, wanted, generation=generation, at=observed.now)
    status = DynamoWorkerStatus(
        observed_generation=generation,
        replicas=min(total, MAX_STATUS_PODS),
        ready_replicas=min(ready, MAX_STATUS_PODS),
        updated_replicas=min(updated, MAX_STATUS_PODS),
        selector=selector_string(name),
        conditions=conditions,
        pods=[_pod_status(p, observed.metadata.get(p.name)) for p in pods],
        frontend=_frontend_status(dw, observed) if frontend is not None else None,
        prefill=_prefill_status(observed) if prefill is not None else None,
        kv_transfer=(observed.kv_transfer or {}).get(DECODE) if prefill is not None else None,
        model_cache=(
            ModelCacheStatus(
                key=cache.key,
                claim_name=cache.claim,
                bytes_done=cache.bytes_done,
                bytes_total=cache.bytes_total,
                stale_key=cache.stale_key,
            )
            if cache is not None
            else None
        ),
        autoscaling=observed.autoscaling if dw.spec.autoscaling is not None else None,
    )
    return status.to_dict()


def _frontend_status(dw: DynamoWorker, observed: WorkerObservation) -> FrontendStatus:
    total, ready, _, _ = _deployment_counts(observed.frontend_deployment)
    return FrontendStatus(
        replicas=min(total, MAX_STATUS_PODS),
        ready_replicas=min(ready, MAX_STATUS_PODS),
        url=frontend_url(dw),
    )


def _prefill_status(observed: WorkerObservation) -> PrefillStatus:
    total, ready, updated, _ = _deployment_counts(observed.prefill_deployment)
    return PrefillStatus(
        replicas=min(total, MAX_STATUS_PODS),
        ready_replicas=min(ready, MAX_STATUS_PODS),
        updated_replicas=min(updated, MAX_STATUS_PODS),
        kv_transfer=(observed.kv_transfer or {}).get(PREFILL),
    )


# A pod that turns ready is in the pod list at once, but in its Deployment's readyReplicas only
# once the Deployment controller counts it: moments later usually, about 10 s at worst under a
# burst of 100-500 creations on the 2-core test bed. A status written in between would
# contradict itself (a ready pod, readyReplicas 0) and be rewritten moments later, so it waits
# for the Deployment to agree, this long at most (what waits is status.pods: Ready and the
# counts come from the Deployment, and are written as soon as it counts the pod).
DEPLOYMENT_LAG_HOLD_SECONDS = 30.0


def _condition_states(status: Mapping[str, Any]) -> dict[str, str]:
    return {str(c.get("type")): str(c.get("status")) for c in status.get("conditions") or []}


def status_hold_seconds(existing: Mapping[str, Any], new: Mapping[str, Any], held: float) -> float:
    """How long more to hold back writing `new` over `existing` (0: write it now), once the
    write has been held back `held` seconds already.

    Held: a status whose pods are ahead of the Deployments' readyReplicas (the decode and
    prefill ones together, with spec.prefill), for up to
    `DEPLOYMENT_LAG_HOLD_SECONDS` in all. Written at once whatever the counts: a new
    generation's first status (clients wait on observedGeneration) and any condition
    transition (each is an Event, and readiness is never late).
    """
    if existing.get("observedGeneration") != new.get("observedGeneration"):
        return 0.0
    if _condition_states(new) != _condition_states(existing):
        return 0.0
    ready_pods = sum(1 for pod in new.get("pods") or [] if pod.get("ready"))
    counted = int(new.get("readyReplicas") or 0)
    counted += int((new.get("prefill") or {}).get("readyReplicas") or 0)
    if ready_pods <= counted:
        return 0.0
    return max(0.0, DEPLOYMENT_LAG_HOLD_SECONDS - held)
