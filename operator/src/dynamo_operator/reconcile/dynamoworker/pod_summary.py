"""What the operator observes about a DynamoWorker's pods, boiled down to what status needs.

`PodSummary.from_pod` reads a Pod manifest (as the watch delivers it) into a small frozen
record; the handlers keep one per pod in memory, so computing status costs no API reads.
`metadata_by_pod` joins the pods to their DynamoWorkerMetadata (the records the workers
publish).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from dynamo_operator.api.dynamoworker import DECODE, PREFILL, WorkerRole
from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.reconcile.dynamoworker.labels import ADAPTERS_READY_GATE, ROLE_LABEL

# The role label's values (anything else is no role).
_ROLES: dict[str, WorkerRole] = {PREFILL: PREFILL, DECODE: DECODE}


class PodProblem(StrEnum):
    """Why a pod cannot serve, grouped by what the user does about it."""

    UNSCHEDULABLE = "Unschedulable"
    IMAGE_PULL = "ImagePull"
    CONFIG = "Config"
    CRASH_LOOP = "CrashLoop"
    OOM_KILLED = "OOMKilled"


# Container waiting reasons, by the problem they mean.
_WAITING_PROBLEMS = {
    "ImagePullBackOff": PodProblem.IMAGE_PULL,
    "ErrImagePull": PodProblem.IMAGE_PULL,
    "InvalidImageName": PodProblem.IMAGE_PULL,
    "CreateContainerConfigError": PodProblem.CONFIG,
    "CreateContainerError": PodProblem.CONFIG,
    "RunContainerError": PodProblem.CRASH_LOOP,
    "CrashLoopBackOff": PodProblem.CRASH_LOOP,
}


@dataclass(frozen=True)
class PodSummary:
    """One worker pod: identity, address, readiness, and the problem it has, if any."""

    name: str
    uid: str
    ip: str | None
    ready: bool
    terminating: bool
    problem: PodProblem | None = None
    problem_detail: str = ""
    restarts: int = 0
    # Its containers are ready (Ready also needs its readiness gates).
    containers_ready: bool = False
    # It carries the LoRA-adapters readiness gate, and that condition's status (None: unset).
    gated: bool = False
    gate_status: str | None = None
    # prefill or decode, for a disaggregated worker's pod (its role label); None: aggregated.
    role: WorkerRole | None = None

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodSummary:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        by_type = {c.get("type"): c.get("status") for c in conditions}
        ready = by_type.get("Ready") == "True"
        gates = (pod.get("spec") or {}).get("readinessGates") or []
        problem, detail = _problem(conditions, status.get("containerStatuses") or [])
        restarts = sum(
            int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []
        )
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            ip=status.get("podIP") or None,
            ready=ready,
            terminating=meta.get("deletionTimestamp") is not None,
            problem=problem,
            problem_detail=detail,
            restarts=restarts,
            containers_ready=by_type.get("ContainersReady") == "True",
            gated=any(g.get("conditionType") == ADAPTERS_READY_GATE for g in gates),
            gate_status=by_type.get(ADAPTERS_READY_GATE),
            role=_ROLES.get((meta.get("labels") or {}).get(ROLE_LABEL, "")),
        )


def _problem(
    conditions: list[Mapping[str, Any]], containers: list[Mapping[str, Any]]
) -> tuple[PodProblem | None, str]:
    for condition in conditions:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return PodProblem.UNSCHEDULABLE, str(condition.get("message") or "")
    for container in containers:
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason")
        last = (container.get("lastState") or {}).get("terminated") or {}
        if last.get("reason") == "OOMKilled" and not state.get("running"):
            return PodProblem.OOM_KILLED, "the container ran out of memory"
        if reason in _WAITING_PROBLEMS:
            message = str(waiting.get("message") or reason)
            return _WAITING_PROBLEMS[reason], message
    return None, ""


def metadata_by_pod(
    pods: Sequence[PodSummary], lookup: Callable[[str], DynamoWorkerMetadata | None]
) -> dict[str, DynamoWorkerMetadata]:
    """The worker pods' DynamoWorkerMetadata by pod name (`lookup(pod name)`; a record is
    named after its pod), for the pods that have one."""
    records = {}
    for pod in pods:
        record = lookup(pod.name)
        if record is not None:
            records[pod.name] = record
    return records
